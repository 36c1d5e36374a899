"""The compiled one-pass copy and CRC32C of the memory tier's slots (``_crc32c_copy``), against
``ctypes.memmove`` and the ``crc32c`` package on every path of its code: the three-chain main
loop of three chains over 3 x 64 KB blocks, the one chain of a remainder and of a smaller item,
its 8-byte words and its last bytes; three small items in lockstep;
misaligned sources and destinations; checksum-only entries; several items in one call; stores
streamed past the caches and ordinary ones."""

from __future__ import annotations

import platform
import random
import shutil
import sys
from array import array

import crc32c
import pytest
import torch

from areal_lightning.write import slot

BLOCK = 64 << 10  # as in _crc32c_copy.c


def test_the_one_pass_copy_is_built_and_used_on_x86_64_linux_with_a_compiler() -> None:
    """``pip install`` builds the optional extension; where it can, a failed build must not pass
    unseen (the slot copy would fall back to copy-then-checksum, 1.4x slower)."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("cc")):
        pytest.skip("the extension is built on x86-64 Linux with a C compiler only")
    assert slot._crc32c_copy is not None, "areal_lightning/write/_crc32c_copy.c was not built: pip install -e ."
    assert slot.FUSED


@pytest.fixture
def native():
    if not slot.FUSED:
        pytest.skip("the compiled _crc32c_copy is not built or this CPU has no SSE4.2")
    return slot._crc32c_copy


def lengths() -> list[int]:
    edge = [0, 1, 7, 8, 9, 63, 64, 4095, 3 * BLOCK - 8, 3 * BLOCK - 1, 3 * BLOCK, 3 * BLOCK + 1, 3 * BLOCK + 8,
            3 * BLOCK + 12345, 6 * BLOCK, 9 * BLOCK - 1, (5 << 20) + 3]
    rng = random.Random(0)
    return edge + [rng.randrange(0, 1 << 21) for _ in range(60)] + [rng.randrange(0, 4096) for _ in range(60)]


@pytest.mark.parametrize("stream_min", [0, 1 << 62], ids=["stores-streamed", "ordinary-stores"])
def test_one_pass_copies_match_memmove_and_their_checksums_the_crc32c_package(native, stream_min) -> None:
    """Every path, with the stores streamed past the caches (a call of 4 MB or more) and with
    ordinary stores (a smaller call)."""
    rng = random.Random(1)
    source = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    sizes = lengths()
    # every item at its own random (mis)alignment, in one destination, with gaps left untouched
    src_at, dst_at, end = [], [], 0
    for n in sizes:
        src_at.append(rng.randrange(0, source.numel() - n))
        end += rng.randrange(1, 17)
        dst_at.append(end)
        end += n
    target = torch.full((end + 16,), 0xA5, dtype=torch.uint8)
    base, src_base = target.data_ptr(), source.data_ptr()
    out = array("I", bytes(4 * len(sizes)))
    native.copy(array("Q", [base + d for d in dst_at]), array("Q", [src_base + s for s in src_at]),
                array("Q", sizes), out, stream_min)
    expected = target.clone().fill_(0xA5)
    for n, s, d, value in zip(sizes, src_at, dst_at, out):
        piece = source[s:s + n]
        expected[d:d + n] = piece
        assert value == crc32c.crc32c(piece.numpy().tobytes()), n
    assert torch.equal(target, expected)  # every byte copied, none outside the items written
    # checksum-only entries (source 0): the CRC32C of the destination's bytes, nothing written
    again = array("I", bytes(4 * len(sizes)))
    native.copy(array("Q", [base + d for d in dst_at]), array("Q", bytes(8 * len(sizes))), array("Q", sizes), again,
                stream_min)
    assert again == out and torch.equal(target, expected)
    # both kinds in one call, interleaved (small items run three of a kind at a time)
    target.fill_(0xA5)
    mixed = array("I", bytes(4 * len(sizes)))
    native.copy(array("Q", [base + d for d in dst_at]),
                array("Q", [src_base + s if i % 3 else 0 for i, s in enumerate(src_at)]), array("Q", sizes), mixed,
                stream_min)
    for i, (n, s, d, value) in enumerate(zip(sizes, src_at, dst_at, mixed)):
        if i % 3 == 0:
            expected[d:d + n] = 0xA5
        assert value == crc32c.crc32c(expected[d:d + n].numpy().tobytes()), (i, n)
    assert torch.equal(target, expected)


def test_one_pass_copy_arguments_of_the_wrong_sizes_are_refused(native) -> None:
    with pytest.raises(ValueError, match="8 bytes per item and out 4"):
        native.copy(array("Q", [1]), array("Q", [1]), array("Q", [1, 2]), array("I", [0]))
    with pytest.raises(TypeError):
        native.copy(array("Q", [1]), array("Q", [1]), array("Q", [1]), b"read-only")


def test_patch_writes_each_records_attribute_at_its_position_and_refuses_what_it_cannot(native) -> None:
    """``patch`` (the CRC32Cs of a ``.metadata`` pickled once, see ``direct.PickledMetadata``):
    each record's attribute as 4 little-endian bytes at its position, nothing else changed; a
    value that is not an int under 2**32, a missing attribute, a position past the buffer or
    positions not one per record raise (bounds checked before anything is written)."""

    class Record:
        pass

    rng = random.Random(1)
    records = [Record() for _ in range(50)]
    for record in records:
        record.crc = rng.randrange(1 << 32)
    records[0].crc, records[1].crc = 0, (1 << 32) - 1
    positions = rng.sample(range(0, 1000, 5), len(records))  # apart, unaligned
    buffer = bytearray(rng.randbytes(1004))
    expected = bytearray(buffer)
    for at, record in zip(positions, records):
        expected[at:at + 4] = record.crc.to_bytes(4, "little")
    native.patch(buffer, array("Q", positions), records, "crc")
    assert buffer == expected
    for bad, error, message in ((1 << 32, ValueError, "record 3's crc is not an int under 2\\*\\*32"),
                                (-1, ValueError, "record 3's crc is not an int"),
                                (7.0, ValueError, "record 3's crc is not an int"),
                                (None, AttributeError, "crc")):
        odd = [*records[:3], Record(), *records[4:]]
        if bad is not None:
            odd[3].crc = bad
        with pytest.raises(error, match=message):
            native.patch(bytearray(buffer), array("Q", positions), odd, "crc")
    untouched = bytearray(buffer)
    with pytest.raises(ValueError, match="position 49 .1001. \\+ 4 is past the buffer's 1004 bytes"):
        native.patch(untouched, array("Q", [*positions[:-1], 1001]), records, "crc")
    assert untouched == buffer
    with pytest.raises(ValueError, match="8 bytes per record"):
        native.patch(bytearray(buffer), array("Q", positions[:-1]), records, "crc")
    with pytest.raises(TypeError):
        native.patch(bytes(buffer), array("Q", positions), records, "crc")


def test_addresses_reads_each_picked_tensors_data_ptr_and_names_the_first_freed_one(native) -> None:
    """``addresses`` (torch's exported data_ptr function, called from C): every picked tensor's
    ``data_ptr()``, storage offsets, any order and repeats included; the position of the first
    tensor whose storage was freed (else -1); an object that is not exactly a ``torch.Tensor``
    (a ``Parameter``, an int), a position past the list, or buffers of other sizes refused with
    nothing called."""
    from areal_lightning._torch_internals import DATA_PTR_FUNCTION

    if DATA_PTR_FUNCTION is None:
        pytest.skip("this torch exports no data_ptr function")
    tensors = [torch.randn(50), torch.arange(10, dtype=torch.int16)[3:], torch.zeros(2, 3), torch.tensor(1.5),
               torch.randn(8, 8).t()]
    index = array("Q", [3, 0, 1, 2, 4, 0])
    out = array("Q", bytes(8 * len(index)))
    assert native.addresses(DATA_PTR_FUNCTION, torch.Tensor, tensors, index, out) == -1
    assert list(out) == [tensors[i].data_ptr() for i in index]
    # a tensor of no elements has address 0 too (a slot copies none: its items have bytes)
    assert native.addresses(DATA_PTR_FUNCTION, torch.Tensor, [tensors[0], torch.empty(0)], array("Q", [0, 1]),
                            array("Q", [0, 0])) == 1
    freed = [torch.ones(4), torch.ones(4), torch.ones(4)]
    for position in (2, 1):
        freed[position].untyped_storage().resize_(0)
        assert native.addresses(DATA_PTR_FUNCTION, torch.Tensor, freed, array("Q", [0, 1, 2]), array("Q", [7] * 3)) \
            == position
    for bad in (torch.nn.Parameter(torch.ones(2)), 3):
        with pytest.raises(TypeError, match="entry 1 .position 1 of 2. is not a Tensor"):
            native.addresses(DATA_PTR_FUNCTION, torch.Tensor, [tensors[0], bad], array("Q", [0, 1]), array("Q", [0, 0]))
    with pytest.raises(TypeError, match="position 5 of 5"):
        native.addresses(DATA_PTR_FUNCTION, torch.Tensor, tensors, array("Q", [5]), array("Q", [0]))
    with pytest.raises(ValueError, match="8 bytes per item"):
        native.addresses(DATA_PTR_FUNCTION, torch.Tensor, tensors, array("Q", [0, 1]), array("Q", [0]))


GROUP, IOVECS, CHUNK = 512 << 10, 256, 6 * BLOCK  # as in _crc32c_copy.c


def test_read_fills_each_destination_from_the_file_and_gives_its_crc32c(native, tmp_path) -> None:
    """``read`` (a local load's tensors, one call per file part): every item's bytes land in its
    destination and its CRC32C is the ``crc32c`` package's, on every path: adjacent small items
    read by one ``preadv`` (runs cut at GROUP bytes and at IOVECS items, and at a gap in the
    file), a large item read CHUNK bytes at a time (its last chunk with a remainder), items of
    no bytes, misaligned destinations; nothing outside an item is written."""
    rng = random.Random(2)
    sizes = lengths() + [GROUP - 1, GROUP, GROUP + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7] + [8] * (IOVECS + 40)
    rng.shuffle(sizes)
    offsets, at = [], 0
    for i, n in enumerate(sizes):
        if i % 17 == 0:
            at += rng.randrange(1, 100)  # a gap: the next item starts another run
        offsets.append(at)
        at += n
    data = torch.randint(0, 256, (at + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "items"
    path.write_bytes(data.numpy().tobytes())
    dst_at, end = [], 0
    for n in sizes:
        end += rng.randrange(1, 17)
        dst_at.append(end)
        end += n
    target = torch.full((end + 16,), 0xA5, dtype=torch.uint8)
    out = array("I", bytes(4 * len(sizes)))
    with open(path, "rb") as f:
        ended, hash_s = native.read(f.fileno(), array("Q", offsets),
                                    array("Q", [target.data_ptr() + d for d in dst_at]), array("Q", sizes), out)
    assert ended == -1 and hash_s > 0
    expected = torch.full_like(target, 0xA5)
    for n, o, d, value in zip(sizes, offsets, dst_at, out):
        expected[d:d + n] = data[o:o + n]
        assert value == crc32c.crc32c(data[o:o + n].numpy().tobytes()), n
    assert torch.equal(target, expected)


@pytest.mark.parametrize("last", [100, GROUP + 10, 3 * CHUNK], ids=["in-a-run", "a-large-item-alone",
                                                                    "a-large-item-in-its-third-chunk"])
def test_read_names_the_first_item_the_file_ends_in(native, tmp_path, last) -> None:
    """A file shorter than its items: ``read`` returns the position of the first item it ends
    in, with the items before it read and checksummed; a failed read raises ``OSError``."""
    data = bytes(range(256)) * 4096  # 1 MB
    path = tmp_path / "short"
    path.write_bytes(data)
    sizes = [1000, 2000, last, 50]
    offsets = [0, 1000, len(data) - last // 2, len(data) + 10]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    out = array("I", bytes(16))
    with open(path, "rb") as f:
        assert native.read(f.fileno(), array("Q", offsets), array("Q", [t.data_ptr() for t in targets]),
                           array("Q", sizes), out)[0] == 2
        fd = f.fileno()
    assert bytes(targets[0].numpy()) == data[:1000] and bytes(targets[1].numpy()) == data[1000:3000]
    assert list(out[:2]) == [crc32c.crc32c(data[:1000]), crc32c.crc32c(data[1000:3000])]
    with pytest.raises(OSError, match="Bad file descriptor"):  # closed
        native.read(fd, array("Q", [0]), array("Q", [targets[0].data_ptr()]), array("Q", [10]), array("I", [0]))
    with pytest.raises(ValueError, match="8 bytes per item and out 4"):
        native.read(0, array("Q", [0]), array("Q", [0, 0]), array("Q", [1]), array("I", [0]))


@pytest.mark.parametrize("how", ["write", "write_at"])
def test_write_puts_each_item_in_the_file_in_order_with_its_crc32c(native, tmp_path, how) -> None:
    """``write`` (a save's items of one file, as buffers) and ``write_at`` (the same, as addresses
    and sizes): the file holds every item's bytes in order and each CRC32C is the ``crc32c``
    package's, on every path: small items checksummed together and written by one ``writev``
    (runs cut at GROUP bytes and IOVECS items), a large item CHUNK bytes at a time (its last
    chunk with a remainder), items of no bytes, ``bytes`` and views of tensors; it appends at the
    file's position; a failed write raises ``OSError``; what is not a contiguous buffer, or
    arrays of unequal lengths, are refused before anything is written."""
    rng = random.Random(3)
    sizes = lengths() + [GROUP - 1, GROUP, GROUP + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7] + [8] * (IOVECS + 40)
    rng.shuffle(sizes)
    source = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    items, at = [], 0
    for i, n in enumerate(sizes):
        piece = source[at:at + n].numpy()
        items.append(piece.tobytes() if i % 2 else memoryview(piece))
        at += n
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    addresses = array("Q", [source.data_ptr() + start if n else 0 for start, n in zip(starts, sizes)])

    def write(fd: int, out: array, count: int | None = None) -> float:
        if how == "write":
            return native.write(fd, items[:count], out)
        return native.write_at(fd, addresses[:count], array("Q", sizes[:count]), out)

    path = tmp_path / "items"
    out = array("I", bytes(4 * len(items)))
    with open(path, "wb") as f:
        f.write(b"head")
        f.flush()
        assert write(f.fileno(), out) >= 0.0
    assert path.read_bytes() == b"head" + source.numpy().tobytes()
    assert list(out) == [crc32c.crc32c(bytes(item)) for item in items]
    for group in ([0], [0, 0], [GROUP, 0, GROUP + 5]):  # no bytes in a writev of its own: nothing written, no error
        data = [bytes(range(256)) * (n // 256) + bytes(n % 256) for n in group]
        keep = [torch.frombuffer(bytearray(piece), dtype=torch.uint8) if piece else torch.empty(0, dtype=torch.uint8)
                for piece in data]
        out = array("I", bytes(4 * len(group)))
        with open(path, "wb") as f:
            if how == "write":
                native.write(f.fileno(), data, out)
            else:
                native.write_at(f.fileno(), array("Q", [t.data_ptr() for t in keep]), array("Q", group), out)
        assert path.read_bytes() == b"".join(data)
        assert list(out) == [crc32c.crc32c(piece) for piece in data]
    with open(path, "rb") as f, pytest.raises(OSError, match="Bad file descriptor"):
        write(f.fileno(), array("I", [0] * 3), 3) if how == "write_at" else native.write(f.fileno(), [b"x" * 100],
                                                                                           array("I", [0]))
    with open(path, "wb") as f:
        with pytest.raises(ValueError, match="4 bytes per item" if how == "write" else "8 bytes per item and out 4"):
            write(f.fileno(), array("I", [0, 0]), 1)
        if how == "write":
            for bad in (3, memoryview(source.numpy()[::2])):
                with pytest.raises((TypeError, BufferError, ValueError)):
                    native.write(f.fileno(), [b"ok", bad], array("I", [0, 0]))
        else:
            with pytest.raises(ValueError, match=r"8 bytes per item and out 4 \(got 16, 24 and 8 bytes\)"):
                native.write_at(f.fileno(), addresses[:2], array("Q", sizes[:3]), array("I", [0, 0]))
    assert path.read_bytes() == b""
