/* Copy and CRC32C in one pass: the memory tier's save point (see areal_lightning/write/slot.py);
 * and a local save's writes and load's reads with their CRC32Cs (write() and read(), see
 * areal_lightning/write/direct.py and dcp_reader.py): each part of a file checksummed right
 * before its write or right after its read, while in the cache, a call per file part with the
 * GIL released instead of a call or two per item in Python.
 *
 * A slot's copy must also give each item's CRC32C. Copying (memmove) and then checksumming
 * (the crc32c package) reads every byte twice; here each 8-byte word is loaded once, stored to
 * the slot and fed to the CPU's CRC32C instruction (SSE4.2) while the memory system is busy
 * with the copy. An item of 192 KB or more runs three independent CRC chains on the three
 * 64 KB thirds of each 192 KB block (the instruction's latency is three times its throughput),
 * joined by multiplying the earlier ones by x^(8 * bytes after them) modulo the Castagnoli
 * polynomial; the rest of it one chain. Smaller items run three at a time in lockstep, one
 * chain each, nothing to join (measured, 2,000 items of 32 KB on one thread: checksums only
 * 7.0 -> 4.2 ms, copies 7.1 -> 6.8 ms; three chains over each item's thirds, joined, were
 * 1.3x slower than one chain: the multiplier of an arbitrary length costs a microsecond).
 *
 * Measured on this project's 2-core machine (benchmarks/many_tensors.py and memory_tier.py):
 * 695 MB copied and checksummed on 2 threads in 0.8-1.0x the time of torch's copy_ of the same
 * tensors, against 1.4x for a memmove then crc32c().
 *
 * No well-kept library offers a copy that checksums as it copies; the crc32c package remains
 * the reference (the tests compare every result with it) and the fallback where this module
 * did not build (it is an optional extension) or the CPU lacks SSE4.2.
 *
 * A call that copies 4 MB or more streams its stores past the caches (see stream_min below), so
 * the slot, read again only by a persist, a peer copy or a resume, does not evict training's
 * data. Measured here against ordinary stores: one thread, one 256 MB item, 30 runs each,
 * interleaved: 11.4 -> 15.3 GB/s; a 695 MB AdamW state on 2 threads, caches flushed between
 * saves: 57.9 -> 37.4 ms; inside a training run (benchmarks/memory_tier.py's model, the two
 * kernels alternating step by step, four runs): 36.1 -> 35.7, 44.9 -> 41.0, 43.8 -> 38.1 and
 * 42.4 -> 45.4 ms, about 4 % on average, within that machine's noise, the next step's time
 * unchanged (0.501 / 0.504 s, 0.518 / 0.514 s). Small items'
 * sources are prefetched 512 bytes ahead: three items in lockstep are six short streams, each
 * too short for the hardware prefetcher to ramp up in time (2,000 items of 32 KB on 2 threads:
 * about 5 % faster, within this machine's noise).
 *
 * Python API (all buffers native-endian, one entry per item):
 *   copy(dsts, srcs, sizes, out[, stream_min])
 *                                 dsts/srcs/sizes: uint64 buffers (addresses, byte counts),
 *                                 out: writable uint32 buffer; copies sizes[i] bytes from
 *                                 srcs[i] to dsts[i] and writes their CRC32C to out[i]
 *                                 (srcs[i] == 0: no copy, the CRC32C of dsts[i]'s bytes).
 *                                 Streams the stores when the call copies stream_min bytes or
 *                                 more (default: stream_min()). Releases the GIL. The caller
 *                                 guarantees the addresses.
 *   addresses(data_ptr, tensor_type, values, index, out)
 *                                 out (writable uint64 buffer): the data_ptr() of the tensors
 *                                 values[index[i]] (values: a list; index: uint64 buffer), read
 *                                 by torch's exported function data_ptr; returns the first i
 *                                 whose address is 0 (freed, or no elements), else -1.
 *   read(fd, offsets, dsts, sizes, out)
 *                                 offsets/dsts/sizes: uint64 buffers, out: writable uint32
 *                                 buffer; reads sizes[i] bytes of the file fd at offsets[i]
 *                                 into dsts[i] and writes their CRC32C to out[i], each part
 *                                 checksummed right after it was read, while in the cache.
 *                                 Returns (-1, or the first i the file ended in (out[j] for
 *                                 j < i filled), the seconds spent checksumming); raises
 *                                 OSError for a failed read. Releases the GIL. The caller
 *                                 guarantees the addresses.
 *   write(fd, items, out)         items: a list of objects with a contiguous buffer (memoryview,
 *                                 bytes), out: writable uint32 buffer; writes each item's bytes
 *                                 to the file fd at its position, in order, and their CRC32C to
 *                                 out[i], each part checksummed right before its write, while in
 *                                 the cache. Returns the seconds spent checksumming; raises
 *                                 OSError for a failed write. Releases the GIL.
 *   write_at(fd, addresses, sizes, out)
 *                                 write() of the items at addresses[i], sizes[i] bytes each
 *                                 (uint64 buffers): a save's tensors without a Python object
 *                                 per item. The caller guarantees the addresses.
 *   supported()                   whether this CPU runs copy() (SSE4.2 on x86-64).
 *   stream_min()                  the default byte count from which a call streams its stores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_KERNEL 1
#include <emmintrin.h>
#include <nmmintrin.h>
#else
#define HAVE_KERNEL 0
#endif

#define POLY 0x82F63B78u   /* Castagnoli, bit-reflected */
#define BLOCK (64 * 1024)  /* bytes per chain (measured: 16 KB was 1.2x slower, 128 KB the same) */
#define AHEAD 512          /* bytes a small item's source is prefetched ahead of its loads */

static uint32_t shift_one, shift_two; /* x^(8 BLOCK), x^(16 BLOCK) mod P: move a chain's CRC past one or two chains */
static int cpu_ok;
/* A call copying this many bytes or more stores them past the caches (non-temporal stores: no
 * read of each destination line first). Measured here (20 items, one thread, 60 runs, caches
 * flushed by 64 MB of other work between runs): 1 MB 93 us ordinary against 98 us streamed,
 * 4 MB 334 / 306 us, 32 MB 2.89 / 2.31 ms; with the slot left in the cache (a copy repeated at
 * once) ordinary stores win below 2 MB (1 MB: 69 / 86 us). */
static const unsigned long long stream_min = 4ull << 20;

/* a * b mod P, polynomials bit-reflected (bit 31: x^0). */
static uint32_t multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {
        product ^= b & (0u - ((a >> (31 - i)) & 1u));
        b = (b >> 1) ^ (POLY & (0u - (b & 1u)));
    }
    return product;
}

static uint32_t power(uint64_t bytes) { /* x^(8 bytes) mod P */
    uint32_t result = 0x80000000u, square = 1u << 23; /* x^0, x^8 */
    for (; bytes; bytes >>= 1, square = multiply(square, square))
        if (bytes & 1) result = multiply(result, square);
    return result;
}

#if HAVE_KERNEL
/* A word stored to the slot: past the caches (MOVNTI) when `streaming`, else an ordinary store. */
#define STORE(at, word, streaming) \
    do { \
        if (streaming) _mm_stream_si64((long long *)(at), (long long)(word)); \
        else memcpy((at), &(word), 8); \
    } while (0)

/* Three chains over the thirds of one block of 3 BLOCK bytes of src, copying to dst when
 * copying; crc: the running (uninverted) CRC before them; returns it after them. */
__attribute__((target("sse4.2")))
static inline uint32_t block(uint8_t *dst, const uint8_t *src, uint32_t crc, int copying, int streaming) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    for (size_t i = 0; i < BLOCK; i += 8) {
        uint64_t x, y, z;
        memcpy(&x, src + i, 8);
        memcpy(&y, src + BLOCK + i, 8);
        memcpy(&z, src + 2 * BLOCK + i, 8);
        c0 = _mm_crc32_u64(c0, x);
        c1 = _mm_crc32_u64(c1, y);
        c2 = _mm_crc32_u64(c2, z);
        if (copying) {
            STORE(dst + i, x, streaming);
            STORE(dst + BLOCK + i, y, streaming);
            STORE(dst + 2 * BLOCK + i, z, streaming);
        }
    }
    return multiply((uint32_t)c0, shift_two) ^ multiply((uint32_t)c1, shift_one) ^ (uint32_t)c2;
}

/* One chain over n bytes of src from the (uninverted) crc, copying to dst when copying. */
__attribute__((target("sse4.2")))
static inline uint32_t chain(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int copying, int streaming) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t x;
        memcpy(&x, src, 8);
        c = _mm_crc32_u64(c, x);
        if (copying) STORE(dst, x, streaming);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n; n--, src++, dst++) {
        c32 = _mm_crc32_u8(c32, *src);
        if (copying) *dst = *src;
    }
    return c32;
}

/* n bytes of src: the blocks of three chains, then one chain over the rest, from the running
 * (uninverted) crc, copying to dst when copying; returns the running CRC after them (a part of
 * an item, whose later parts go on from it: a read or write a chunk at a time). */
__attribute__((target("sse4.2")))
static inline uint32_t extend(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int copying, int streaming) {
    for (; n >= 3 * (size_t)BLOCK; n -= 3 * (size_t)BLOCK, src += 3 * (size_t)BLOCK, dst += 3 * (size_t)BLOCK)
        crc = block(dst, src, crc, copying, streaming);
    return chain(dst, src, n, crc, copying, streaming);
}

/* One item whole: its CRC32C. */
__attribute__((target("sse4.2")))
static inline uint32_t run(uint8_t *dst, const uint8_t *src, size_t n, int copying, int streaming) {
    return ~extend(dst, src, n, 0xFFFFFFFFu, copying, streaming);
}

/* Three small items of the same mode (copying, or checksums only) in lockstep, one chain
 * each, over the words all three have; then each one's rest on its own. */
__attribute__((target("sse4.2")))
static void three(uint8_t *const *dst, const uint8_t *const *src, const size_t *n, uint32_t *out, int copying,
                  int streaming) {
    size_t m = n[0] < n[1] ? n[0] : n[1];
    m = (m < n[2] ? m : n[2]) & ~(size_t)7;
    /* the addresses in locals: a store through one must not make the compiler reload them */
    uint8_t *d0 = dst[0], *d1 = dst[1], *d2 = dst[2];
    const uint8_t *s0 = src[0], *s1 = src[1], *s2 = src[2];
    uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
    for (size_t i = 0; i < m; i += 8) {
        uint64_t x, y, z;
        memcpy(&x, s0 + i, 8);
        memcpy(&y, s1 + i, 8);
        memcpy(&z, s2 + i, 8);
        c0 = _mm_crc32_u64(c0, x);
        c1 = _mm_crc32_u64(c1, y);
        c2 = _mm_crc32_u64(c2, z);
        if ((i & 63) == 0) { /* six short streams: the hardware prefetcher ramps up too late for each */
            __builtin_prefetch(s0 + i + AHEAD);
            __builtin_prefetch(s1 + i + AHEAD);
            __builtin_prefetch(s2 + i + AHEAD);
        }
        if (copying) {
            STORE(d0 + i, x, streaming);
            STORE(d1 + i, y, streaming);
            STORE(d2 + i, z, streaming);
        }
    }
    out[0] = ~chain(dst[0] + m, src[0] + m, n[0] - m, (uint32_t)c0, copying, streaming);
    out[1] = ~chain(dst[1] + m, src[1] + m, n[1] - m, (uint32_t)c1, copying, streaming);
    out[2] = ~chain(dst[2] + m, src[2] + m, n[2] - m, (uint32_t)c2, copying, streaming);
}

/* Every item: a large one (one block or more) on its own; small ones three at a time, each
 * three of the same mode (a source, or none: the checksum of dst's bytes), in lockstep. */
static void copy_all(const uint64_t *d, const uint64_t *s, const uint64_t *n, uint32_t *o, Py_ssize_t count,
                     unsigned long long streaming_from) {
    Py_ssize_t waiting[2][3];
    int held[2] = {0, 0};
    unsigned long long copied = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        if (s[i]) copied += n[i];
    int streaming = copied >= streaming_from;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t *dst = (uint8_t *)(uintptr_t)d[i];
        const uint8_t *src = (const uint8_t *)(uintptr_t)s[i];
        int copying = src != NULL;
        if (n[i] >= 3 * (uint64_t)BLOCK) {
            o[i] = run(dst, copying ? src : dst, (size_t)n[i], copying, streaming);
            continue;
        }
        waiting[copying][held[copying]++] = i;
        if (held[copying] == 3) {
            Py_ssize_t *w = waiting[copying];
            uint8_t *dsts[3];
            const uint8_t *srcs[3];
            size_t sizes[3];
            uint32_t crcs[3];
            for (int j = 0; j < 3; j++) {
                dsts[j] = (uint8_t *)(uintptr_t)d[w[j]];
                srcs[j] = copying ? (const uint8_t *)(uintptr_t)s[w[j]] : dsts[j];
                sizes[j] = (size_t)n[w[j]];
            }
            three(dsts, srcs, sizes, crcs, copying, streaming);
            for (int j = 0; j < 3; j++) o[w[j]] = crcs[j];
            held[copying] = 0;
        }
    }
    for (int copying = 0; copying < 2; copying++)
        for (int j = 0; j < held[copying]; j++) {
            Py_ssize_t i = waiting[copying][j];
            uint8_t *dst = (uint8_t *)(uintptr_t)d[i];
            o[i] = run(dst, copying ? (const uint8_t *)(uintptr_t)s[i] : dst, (size_t)n[i], copying, streaming);
        }
    if (streaming) _mm_sfence(); /* the streamed stores visible before the call returns */
}

/* A load's reads (read() below): the file read into each destination a part at a time, each
 * part checksummed right after its read while it is in the cache, instead of a read then a
 * checksum pass over memory the read has left (the Python reader's way, a call or two per item
 * with the GIL taken between). Adjacent items under GROUP bytes are read by one preadv of up to
 * GROUP bytes and IOVECS items; a larger item is read CHUNK bytes at a time (a multiple of the
 * three-chain block, so its CRC runs as copy()'s does). */
#define GROUP (512 * 1024)
#define IOVECS 256
#define CHUNK (2 * 3 * BLOCK)

static const uint64_t none[IOVECS]; /* no sources: copy_all checksums the given memory (a group's) */

/* Seconds on a monotonic clock (the checksums' share of a read or write, for telemetry). */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* pread until n bytes or the end of the file; returns the bytes read, -1 (errno in *err). */
static ssize_t read_fully(int fd, uint8_t *dst, size_t n, uint64_t offset, int *err) {
    size_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, dst + done, n - done, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (got == 0) break;
        done += (size_t)got;
    }
    return (ssize_t)done;
}

/* Items [first, last) (adjacent in the file, each under GROUP bytes) by one preadv, finished
 * item by item where it read short; returns -1 or the first item the file ended in. */
static Py_ssize_t read_group(int fd, const uint64_t *at, const uint64_t *d, const uint64_t *n, Py_ssize_t first,
                             Py_ssize_t last, int *err) {
    struct iovec iov[IOVECS];
    size_t total = 0;
    for (Py_ssize_t i = first; i < last; i++) {
        iov[i - first].iov_base = (void *)(uintptr_t)d[i];
        iov[i - first].iov_len = (size_t)n[i];
        total += (size_t)n[i];
    }
    ssize_t got;
    do got = preadv(fd, iov, (int)(last - first), (off_t)at[first]); while (got < 0 && errno == EINTR);
    if (got < 0) {
        *err = errno;
        return -1;
    }
    if ((size_t)got == total) return -1;
    size_t start = 0; /* of item i in the group */
    for (Py_ssize_t i = first; i < last; start += (size_t)n[i], i++) {
        if ((size_t)got >= start + n[i]) continue;
        size_t have = (size_t)got > start ? (size_t)got - start : 0;
        ssize_t more = read_fully(fd, (uint8_t *)(uintptr_t)d[i] + have, (size_t)n[i] - have, at[i] + have, err);
        if (more < 0) return -1;
        if ((size_t)more < (size_t)n[i] - have) return i;
    }
    return -1;
}

/* One large item read CHUNK bytes at a time, each chunk checksummed after its read; returns
 * 0, 1 (the file ended in it) or -1 (errno in *err). */
__attribute__((target("sse4.2")))
static int read_large(int fd, uint64_t at, uint8_t *dst, size_t n, uint32_t *crc_out, int *err, double *hash_s) {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t done = 0; done < n;) {
        size_t want = n - done < (size_t)CHUNK ? n - done : (size_t)CHUNK;
        ssize_t got = read_fully(fd, dst + done, want, at + done, err);
        if (got < 0) return -1;
        if ((size_t)got < want) return 1;
        double start = now();
        crc = extend(dst + done, dst + done, want, crc, 0, 0);
        *hash_s += now() - start;
        done += want;
    }
    *crc_out = ~crc;
    return 0;
}

/* writev every byte of iov[0..count) (advanced in place past a short write); 0 or errno. */
static int write_fully(int fd, struct iovec *iov, int count) {
    while (count > 0) {
        while (count > 0 && iov->iov_len == 0) { /* items of no bytes: nothing to write (a writev of 0 bytes returns 0) */
            iov++;
            count--;
        }
        if (count == 0) break;
        ssize_t put = writev(fd, iov, count > IOVECS ? IOVECS : count);
        if (put < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (put == 0) return EIO; /* nothing taken while bytes remain: never loop on it */
        while (count > 0 && (size_t)put >= iov->iov_len) {
            put -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + put;
            iov->iov_len -= (size_t)put;
        }
    }
    return 0;
}

/* A save's items (item i: n[i] bytes at a[i]) written in order (write() and write_at() below):
 * adjacent items under GROUP bytes checksummed together and written by one writev of up to GROUP
 * bytes; a larger item CHUNK bytes at a time, each chunk checksummed, then written while in the
 * cache. Returns 0 or errno; *hash_s: the seconds spent checksumming. */
__attribute__((target("sse4.2")))
static int write_all(int fd, const uint64_t *a, const uint64_t *n, Py_ssize_t count, uint32_t *o, double *hash_s) {
    struct iovec iov[IOVECS];
    for (Py_ssize_t i = 0; i < count;) {
        uint8_t *at = (uint8_t *)(uintptr_t)a[i]; /* read only: checksums store nothing */
        size_t size = (size_t)n[i];
        if (size >= GROUP) {
            uint32_t crc = 0xFFFFFFFFu;
            for (size_t done = 0; done < size;) {
                size_t want = size - done < (size_t)CHUNK ? size - done : (size_t)CHUNK;
                uint8_t *part = at + done;
                double start = now();
                crc = extend(part, part, want, crc, 0, 0);
                *hash_s += now() - start;
                struct iovec one = {part, want};
                int err = write_fully(fd, &one, 1);
                if (err) return err;
                done += want;
            }
            o[i++] = ~crc;
            continue;
        }
        Py_ssize_t last = i;
        size_t bytes = 0;
        while (last < count && last - i < IOVECS && (size_t)n[last] < GROUP
               && (last == i || bytes + (size_t)n[last] <= GROUP)) {
            iov[last - i].iov_base = (void *)(uintptr_t)a[last];
            iov[last - i].iov_len = (size_t)n[last];
            bytes += (size_t)n[last++];
        }
        double start = now();
        copy_all(a + i, none, n + i, o + i, last - i, ULLONG_MAX); /* no sources: the items' own bytes, read only */
        *hash_s += now() - start;
        int err = write_fully(fd, iov, (int)(last - i));
        if (err) return err;
        i = last;
    }
    return 0;
}

static Py_ssize_t read_all(int fd, const uint64_t *at, const uint64_t *d, const uint64_t *n, uint32_t *o,
                           Py_ssize_t count, int *err, double *hash_s) {
    for (Py_ssize_t i = 0; i < count;) {
        if (n[i] >= GROUP) {
            int ended = read_large(fd, at[i], (uint8_t *)(uintptr_t)d[i], (size_t)n[i], &o[i], err, hash_s);
            if (ended) return ended < 0 ? -1 : i;
            i++;
            continue;
        }
        Py_ssize_t last = i + 1;
        uint64_t bytes = n[i];
        while (last < count && last - i < IOVECS && n[last] < GROUP && at[last] == at[last - 1] + n[last - 1]
               && bytes + n[last] <= GROUP)
            bytes += n[last++];
        Py_ssize_t ended = read_group(fd, at, d, n, i, last, err);
        if (*err) return -1;
        Py_ssize_t upto = ended >= 0 ? ended : last; /* before the item the file ended in: read */
        double start = now();
        copy_all(d + i, none, n + i, o + i, upto - i, ULLONG_MAX);
        *hash_s += now() - start;
        if (ended >= 0) return ended;
        i = last;
    }
    return -1;
}
#endif

/* Whether this CPU runs the kernel; else RuntimeError naming the function `name`. */
static int kernel_ready(const char *name) {
    if (!cpu_ok) PyErr_Format(PyExc_RuntimeError, "_crc32c_copy.%s: this CPU has no SSE4.2 CRC32C (check supported())", name);
    return cpu_ok;
}

/* The item count of three uint64 buffers and a uint32 one of one entry per item; else -1 and
 * ValueError naming the function and the buffers (`names`). */
static Py_ssize_t items_of(const char *name, const char *names, const Py_buffer *a, const Py_buffer *b,
                           const Py_buffer *c, const Py_buffer *out) {
    Py_ssize_t count = out->len / 4;
    if (out->len % 4 || a->len != count * 8 || b->len != count * 8 || c->len != count * 8) {
        PyErr_Format(PyExc_ValueError, "_crc32c_copy.%s: %s need 8 bytes per item and out 4 (got %zd, %zd, %zd and %zd "
                     "bytes)", name, names, a->len, b->len, c->len, out->len);
        return -1;
    }
    return count;
}

static PyObject *py_copy(PyObject *self, PyObject *args) {
    Py_buffer dsts, srcs, sizes, out;
    unsigned long long streaming_from = stream_min;
    if (!kernel_ready("copy")) return NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*w*|K:copy", &dsts, &srcs, &sizes, &out, &streaming_from)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = items_of("copy", "dsts, srcs and sizes", &dsts, &srcs, &sizes, &out);
    if (count < 0) goto done;
#if HAVE_KERNEL
    {
        const uint64_t *d = dsts.buf, *s = srcs.buf, *n = sizes.buf;
        uint32_t *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        copy_all(d, s, n, o, count, streaming_from);
        Py_END_ALLOW_THREADS
    }
#endif
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dsts);
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    return result;
}

/* addresses(data_ptr, tensor_type, values, index, out): out[i] = data_ptr(values[index[i]]) for
 * each i, where data_ptr is torch's exported `void *(*)(PyObject *)` (an int: its address; see
 * areal_lightning/_torch_internals.py DATA_PTR_FUNCTION) and every object it is given has exactly
 * the type tensor_type (else TypeError; the function throws a C++ exception for a non-tensor,
 * which no C frame may see). Returns the first i whose address is 0 (a tensor whose storage was
 * freed, or one of no elements), else -1. One call instead of a Python call per tensor: the loads of many tensors'
 * metadata overlap (2,000 tensors, caches cold: see slot.py). */
static PyObject *py_addresses(PyObject *self, PyObject *args) {
    PyObject *function, *type, *values;
    Py_buffer index, out;
    if (!PyArg_ParseTuple(args, "OO!O!y*w*:addresses", &function, &PyType_Type, &type, &PyList_Type, &values,
                          &index, &out))
        return NULL;
    PyObject *result = NULL;
    void *(*data_ptr)(PyObject *) = (void *(*)(PyObject *))PyLong_AsVoidPtr(function);
    Py_ssize_t count = out.len / 8, length = PyList_GET_SIZE(values), zero = -1;
    if (data_ptr == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_crc32c_copy.addresses: data_ptr is 0");
        goto done;
    }
    if (out.len % 8 || index.len != out.len) {
        PyErr_Format(PyExc_ValueError, "_crc32c_copy.addresses: index and out need 8 bytes per item (got %zd and "
                     "%zd bytes)", index.len, out.len);
        goto done;
    }
    const uint64_t *at = index.buf;
    for (Py_ssize_t i = 0; i < count; i++) /* every object checked before the first call */
        if (at[i] >= (uint64_t)length || Py_TYPE(PyList_GET_ITEM(values, (Py_ssize_t)at[i])) != (PyTypeObject *)type) {
            PyErr_Format(PyExc_TypeError, "_crc32c_copy.addresses: entry %zd (position %llu of %zd) is not a %s",
                         i, (unsigned long long)at[i], length, ((PyTypeObject *)type)->tp_name);
            goto done;
        }
    uint64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        o[i] = (uint64_t)(uintptr_t)data_ptr(PyList_GET_ITEM(values, (Py_ssize_t)at[i]));
        if (!o[i] && zero < 0) zero = i;
    }
    result = PyLong_FromSsize_t(zero);
done:
    PyBuffer_Release(&index);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_read(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer offsets, dsts, sizes, out;
    if (!kernel_ready("read")) return NULL;
    if (!PyArg_ParseTuple(args, "iy*y*y*w*:read", &fd, &offsets, &dsts, &sizes, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = items_of("read", "offsets, dsts and sizes", &offsets, &dsts, &sizes, &out), ended = -1;
    int err = 0;
    double hash_s = 0.0;
    if (count < 0) goto done;
#if HAVE_KERNEL
    {
        const uint64_t *at = offsets.buf, *d = dsts.buf, *n = sizes.buf;
        uint32_t *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        ended = read_all(fd, at, d, n, o, count, &err, &hash_s);
        Py_END_ALLOW_THREADS
    }
#endif
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("nd", ended, hash_s);
done:
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&dsts);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    return result;
}

/* write_all() with the GIL released: the seconds spent checksumming, or NULL and OSError. */
static PyObject *written(int fd, const uint64_t *a, const uint64_t *n, Py_ssize_t count, Py_buffer *out) {
    int err = 0;
    double hash_s = 0.0;
#if HAVE_KERNEL
    uint32_t *o = out->buf;
    Py_BEGIN_ALLOW_THREADS
    err = write_all(fd, a, n, count, o, &hash_s);
    Py_END_ALLOW_THREADS
#endif
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyFloat_FromDouble(hash_s);
}

static PyObject *py_write(PyObject *self, PyObject *args) {
    int fd;
    PyObject *items;
    Py_buffer out;
    if (!kernel_ready("write")) return NULL;
    if (!PyArg_ParseTuple(args, "iO!w*:write", &fd, &PyList_Type, &items, &out)) return NULL;
    PyObject *result = NULL;
    items = PyList_AsTuple(items); /* a buffer export runs Python code that could change a list */
    if (items == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(items), held = 0;
    Py_buffer *views = NULL;
    uint64_t *spans = NULL; /* each item's address, then each one's size */
    if (out.len != count * 4) {
        PyErr_Format(PyExc_ValueError, "_crc32c_copy.write: out needs 4 bytes per item (got %zd bytes for %zd items)",
                     out.len, count);
        goto done;
    }
    views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    spans = PyMem_Calloc(count ? 2 * (size_t)count : 1, sizeof(uint64_t));
    if (views == NULL || spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) { /* every buffer held (its object alive, C-contiguous) while the GIL is released */
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(items, held), &views[held], PyBUF_SIMPLE) < 0) goto done;
        spans[held] = (uint64_t)(uintptr_t)views[held].buf;
        spans[count + held] = (uint64_t)views[held].len;
    }
    result = written(fd, spans, spans + count, count, &out);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    PyBuffer_Release(&out);
    Py_DECREF(items);
    return result;
}

static PyObject *py_write_at(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer addresses, sizes, out;
    if (!kernel_ready("write_at")) return NULL;
    if (!PyArg_ParseTuple(args, "iy*y*w*:write_at", &fd, &addresses, &sizes, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = out.len / 4;
    if (out.len % 4 || addresses.len != count * 8 || sizes.len != count * 8)
        PyErr_Format(PyExc_ValueError, "_crc32c_copy.write_at: addresses and sizes need 8 bytes per item and out 4 "
                     "(got %zd, %zd and %zd bytes)", addresses.len, sizes.len, out.len);
    else
        result = written(fd, addresses.buf, sizes.buf, count, &out);
    PyBuffer_Release(&addresses);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    return result;
}

/* patch(buffer, positions, records, name): for each i, the int attribute `name` of records[i]
 * (under 2**32: a CRC32C) written as 4 little-endian bytes at buffer[positions[i]] (positions:
 * 8 bytes each, every one + 4 within the buffer; checked before anything is written). One call
 * instead of reading 2,000 records' attributes into an array and scattering its bytes by an
 * indexed copy (see direct.py PickledMetadata). */
static PyObject *py_patch(PyObject *self, PyObject *args) {
    Py_buffer buffer, positions;
    PyObject *records, *name;
    if (!PyArg_ParseTuple(args, "w*y*O!U:patch", &buffer, &positions, &PyList_Type, &records, &name)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = positions.len / 8;
    const uint64_t *at = positions.buf;
    unsigned char *out = buffer.buf;
    records = PyList_AsTuple(records); /* an attribute read runs Python code that could change a list */
    if (records == NULL) goto done;
    if (positions.len % 8 || count != PyTuple_GET_SIZE(records)) {
        PyErr_Format(PyExc_ValueError, "_crc32c_copy.patch: positions need 8 bytes per record (got %zd bytes for %zd "
                     "records)", positions.len, PyTuple_GET_SIZE(records));
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (buffer.len < 4 || at[i] > (uint64_t)(buffer.len - 4)) {
            PyErr_Format(PyExc_ValueError, "_crc32c_copy.patch: position %zd (%llu) + 4 is past the buffer's %zd bytes",
                         i, (unsigned long long)at[i], buffer.len);
            goto done;
        }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyObject_GetAttr(PyTuple_GET_ITEM(records, i), name);
        if (value == NULL) goto done;
        unsigned long long v = PyLong_Check(value) ? PyLong_AsUnsignedLongLong(value) : (unsigned long long)-1;
        Py_DECREF(value);
        if (v > 0xFFFFFFFFULL) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "_crc32c_copy.patch: record %zd's %U is not an int under 2**32", i, name);
            }
            goto done;
        }
        unsigned char *p = out + at[i];
        p[0] = (unsigned char)v;
        p[1] = (unsigned char)(v >> 8);
        p[2] = (unsigned char)(v >> 16);
        p[3] = (unsigned char)(v >> 24);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(records);
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&positions);
    return result;
}

static PyObject *py_supported(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(cpu_ok);
}

static PyObject *py_stream_min(PyObject *self, PyObject *noargs) {
    return PyLong_FromUnsignedLongLong(stream_min);
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy(dsts, srcs, sizes, out): copy each item and write its CRC32C (see the module source)."},
    {"addresses", py_addresses, METH_VARARGS,
     "addresses(data_ptr, tensor_type, values, index, out): each tensor's data_ptr() (see the module source)."},
    {"read", py_read, METH_VARARGS,
     "read(fd, offsets, dsts, sizes, out): read each item into its destination and write its CRC32C (see the "
     "module source)."},
    {"write", py_write, METH_VARARGS,
     "write(fd, items, out): write each item's bytes and its CRC32C (see the module source)."},
    {"write_at", py_write_at, METH_VARARGS,
     "write_at(fd, addresses, sizes, out): write() of the bytes at the given addresses (see the module source)."},
    {"patch", py_patch, METH_VARARGS,
     "patch(buffer, positions, records, name): each record's int attribute as 4 little-endian bytes at its position "
     "(see the module source)."},
    {"supported", py_supported, METH_NOARGS, "Whether this CPU runs copy()."},
    {"stream_min", py_stream_min, METH_NOARGS, "Bytes from which a copy() call streams its stores past the caches."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c_copy", "Copy and CRC32C in one pass.", -1, methods};

PyMODINIT_FUNC PyInit__crc32c_copy(void) {
    shift_one = power(BLOCK);
    shift_two = power(2 * BLOCK);
#if HAVE_KERNEL
    __builtin_cpu_init();
    cpu_ok = __builtin_cpu_supports("sse4.2");
#endif
    return PyModule_Create(&module);
}
