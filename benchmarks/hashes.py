"""Which checksum should the writer threads compute? Throughput of the candidates on this machine.

Usage::

    python benchmarks/hashes.py [--mb 256] [--repeat 5] [--json FILE]

Every candidate hashes the same ``--mb`` MB buffer (already in memory, pages touched), in
one call and in 1 MB updates (the size of the writes of a DCP writer thread), on one
thread and on two threads at once (DCP writes with two threads per rank: a hash that
holds the GIL does not scale). ``memcpy`` (``torch.Tensor.copy_``) is the scale: a hash
slower than a copy costs more than staging. Medians of ``--repeat`` runs, GB/s.

Candidates: ``zlib.crc32`` (the previous manifest checksum), ``crc32c`` (ICRAR, SSE4.2
hardware CRC), ``google-crc32c`` (Google's C extension; it accepts ``bytes`` only, so a copy is included), ``xxhash`` ``xxh3_64``,
``xxh3_128`` and ``xxh64``.

A second table times a copy that also gives the CRC32C of what it copied (the memory tier's
save point), each thread copying the whole buffer into a destination of its own: ``copy_``
alone (the scale), ``memmove`` then ``crc32c`` 1 MB at a time (the tier without its compiled
extension), and the extension's one pass (``_crc32c_copy``: each word loaded once, stored and
CRC'd). GB/s of bytes copied.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
from _report import write_json

_UPDATE = 1 << 20


def candidates() -> dict[str, Callable[[], object]]:
    """name -> factory of an object with ``update(buffer)`` (or ``None`` if not installed)."""
    found: dict[str, Callable[[], object]] = {}

    class _Crc32:
        def __init__(self) -> None:
            self.value = 0

        def update(self, data) -> None:
            self.value = zlib.crc32(data, self.value)

    found["zlib.crc32"] = _Crc32
    try:
        import crc32c

        found["crc32c"] = crc32c.CRC32CHash
    except ImportError:
        pass
    try:
        import google_crc32c

        class _Google:  # its C extension takes bytes only (no memoryview): the copy is part of its cost
            def __init__(self) -> None:
                self.value = 0

            def update(self, data) -> None:
                self.value = google_crc32c.extend(self.value, bytes(data))

        found["google_crc32c"] = _Google
    except ImportError:
        pass
    try:
        import xxhash

        found["xxh3_64"] = xxhash.xxh3_64
        found["xxh3_128"] = xxhash.xxh3_128
        found["xxh64"] = xxhash.xxh64
    except ImportError:
        pass
    return found


def _memcpy(view: memoryview, out: torch.Tensor) -> None:
    out.copy_(torch.frombuffer(view, dtype=torch.uint8))


def _hash_all(make: Callable[[], object], view: memoryview) -> None:
    make().update(view)


def _hash_chunks(make: Callable[[], object], view: memoryview) -> None:
    h = make()
    for start in range(0, len(view), _UPDATE):
        h.update(view[start:start + _UPDATE])


def copy_candidates(data: torch.Tensor, threads: int) -> dict[str, Callable[[int], None]]:
    """name -> ``copy(thread)``: ``data`` copied into thread ``thread``'s own destination, with
    its CRC32C where the name says so."""
    import ctypes
    from array import array

    import crc32c

    outs = [torch.empty_like(data) for _ in range(threads)]
    nbytes, source = data.numel(), data.data_ptr()

    def copy_only(thread: int) -> None:
        outs[thread].copy_(data)

    def two_passes(thread: int) -> None:
        out, value = outs[thread], 0
        view = memoryview(out.numpy())
        for start in range(0, nbytes, _UPDATE):
            size = min(_UPDATE, nbytes - start)
            ctypes.memmove(out.data_ptr() + start, source + start, size)
            value = crc32c.crc32c(view[start:start + size], value)

    found = {"copy_ (scale)": copy_only, "memmove, then crc32c": two_passes}
    try:
        from areal_lightning.write import _crc32c_copy
    except ImportError:
        return found
    if _crc32c_copy.supported():
        def one_pass(thread: int) -> None:
            _crc32c_copy.copy(array("Q", [outs[thread].data_ptr()]), array("Q", [source]), array("Q", [nbytes]),
                              array("I", [0]))

        found["one pass (ours)"] = one_pass
    return found


def _timed_threads(fn: Callable[[int], None], threads: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        workers = [threading.Thread(target=fn, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed(fn: Callable[[], None], threads: int, repeat: int) -> float:
    return _timed_threads(lambda thread: fn(), threads, repeat)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    nbytes = int(args.mb * 2**20)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    out = torch.empty_like(data)
    rows = []
    tests = {"memcpy": None, **candidates()}
    for name, make in tests.items():
        row = {"name": name}
        for mode, threads in (("one_call", 1), ("1mb_updates", 1), ("2_threads", 2)):
            if make is None:
                fn = lambda: _memcpy(view, out)  # noqa: E731
            elif mode == "one_call":
                fn = lambda make=make: _hash_all(make, view)  # noqa: E731
            else:
                fn = lambda make=make: _hash_chunks(make, view)  # noqa: E731
            fn()  # warm up
            seconds = _timed(fn, threads, args.repeat)
            row[f"{mode}_gbps"] = threads * nbytes / seconds / 1e9
        rows.append(row)
    best = max((r for r in rows if r["name"] != "memcpy"), key=lambda r: r["2_threads_gbps"])
    print(f"{'hash':<14} {'one call GB/s':>14} {'1 MB updates':>13} {'2 threads':>10}")
    for r in rows:
        print(f"{r['name']:<14} {r['one_call_gbps']:>14.2f} {r['1mb_updates_gbps']:>13.2f} {r['2_threads_gbps']:>10.2f}")
    print(f"fastest on 2 threads: {best['name']}")
    copies = []
    for threads in (1, 2):
        for name, fn in copy_candidates(data, threads).items():
            for thread in range(threads):
                fn(thread)  # warm up: the destinations' pages touched
            seconds = _timed_threads(fn, threads, args.repeat)
            copies.append({"name": name, "threads": threads, "gbps": threads * nbytes / seconds / 1e9})
    scale = {r["threads"]: r["gbps"] for r in copies if r["name"] == "copy_ (scale)"}
    print(f"\n{'copy with its CRC32C':<24} {'threads':>7} {'GB/s':>7} {'time / copy_':>13}")
    for r in copies:
        r["time_vs_copy"] = scale[r["threads"]] / r["gbps"]
        print(f"{r['name']:<24} {r['threads']:>7} {r['gbps']:>7.2f} {r['time_vs_copy']:>13.2f}")
    write_json(args.json, {"benchmark": "hashes", "mb": args.mb, "repeat": args.repeat, "rows": rows,
                           "fastest": best["name"], "copies": copies})
    return 0


if __name__ == "__main__":
    sys.exit(main())
