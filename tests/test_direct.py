"""Saves and loads that need no planning (areal_lightning.write.direct).

A rank-local save of plain tensors is laid out by the engine itself (layout cached between
saves) and a load whose tensors are each one whole chunk into a contiguous CPU destination is
read without DCP's planner. What they write must be what DCP's planner records, they must
fall back to DCP wherever planning is needed, and a save must fail as a whole.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from array import array
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from areal_lightning.errors import CheckpointCorruptError, CheckpointWriteError, UsageError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.stage.host import pinning_possible
from areal_lightning.write import direct
from areal_lightning.write.dcp import DCPEngine
from areal_lightning.write.dcp_format import SKELETON_KEY, UNNAMED, TensorSlot, flatten


def _state(step: int = 3, grown: int = 0) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "state_dict": {
            "big": torch.randn(600, 600, generator=gen),  # 1.4 MB: its own file
            "w": torch.randn(16, 8, generator=gen),
            "bf16": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
            "ids": torch.arange(5),
            "empty": torch.zeros(0, 3),
            "transposed": torch.randn(3, 5, generator=gen).t(),
        },
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(7, generator=gen)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "log": ["x" * 100] * grown,  # a growing non-tensor part: a longer skeleton
        "step": step,
    }


def test_a_save_without_plan_records_what_dcps_planner_records(tmp_path: Path) -> None:
    state = _state()
    engine = DCPEngine()
    engine.save(state, tmp_path / "ours")
    assert engine._layout is not None and not engine._plan_keys  # no DCP plan was made
    flat = flatten(state)
    flat.pop(SKELETON_KEY)
    dcp.save(flat, checkpoint_id=tmp_path / "stock", planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)
    ours, stock = FileSystemReader(tmp_path / "ours").read_metadata(), FileSystemReader(tmp_path / "stock").read_metadata()
    assert {k: v for k, v in ours.state_dict_metadata.items() if k != SKELETON_KEY} == stock.state_dict_metadata
    assert set(ours.storage_data) == set(stock.storage_data) | {next(i for i in ours.storage_data if i.fqn == SKELETON_KEY)}
    assert ours.version == stock.version and ours.planner_data == stock.planner_data
    for index, info in ours.storage_data.items():
        if index.fqn != SKELETON_KEY:
            md = ours.state_dict_metadata[index.fqn]
            assert info.length == md.size.numel() * md.properties.dtype.itemsize  # raw bytes: the tensor's size
    engine.close()


def test_the_layout_is_reused_while_the_skeleton_grows_and_every_save_loads(tmp_path: Path) -> None:
    engine = DCPEngine()
    offsets = []
    for step, grown in ((1, 0), (2, 50), (3, 3)):
        path = tmp_path / f"c{step}"
        engine.save(_state(step, grown), path)
        md = FileSystemReader(path).read_metadata()
        offsets.append({i.fqn: (info.relative_path, info.offset) for i, info in md.storage_data.items()
                        if i.fqn != SKELETON_KEY})
        loaded = engine.load(path)
        expected = _state(step, grown)
        for key, tensor in expected["state_dict"].items():
            assert torch.equal(loaded["state_dict"][key], tensor) and loaded["state_dict"][key].dtype == tensor.dtype
        assert loaded["log"] == expected["log"] and loaded["optimizer"]["state"][0]["step"].item() == step
    assert offsets[0] == offsets[1] == offsets[2]  # tensors stay where the layout put them
    assert len({info[0] for info in offsets[0].values()}) == 2  # the big tensor in a file of its own
    engine.close()


def test_a_loaded_template_is_filled_in_place_and_reshaped_destinations_fall_back_to_dcp(tmp_path: Path) -> None:
    state = _state()
    engine = DCPEngine()
    engine.save(state, tmp_path / "c")
    template = {"state_dict": {k: torch.empty_like(v) for k, v in state["state_dict"].items()}}
    pointers = {k: v.data_ptr() for k, v in template["state_dict"].items() if v.numel()}
    loaded = engine.load(tmp_path / "c", template=template)
    for key, pointer in pointers.items():
        assert loaded["state_dict"][key].data_ptr() == pointer, key
        assert torch.equal(loaded["state_dict"][key], state["state_dict"][key])
    # a non-contiguous destination (DCP plans the load and copies into it)
    odd = {"state_dict": {"w": torch.empty(8, 16).t()}}
    loaded = engine.load(tmp_path / "c", template=odd)
    assert loaded["state_dict"]["w"] is odd["state_dict"]["w"] and torch.equal(odd["state_dict"]["w"], state["state_dict"]["w"])
    engine.close()


def test_the_skeleton_names_a_tensor_by_its_path_only_when_fill_can_tell_it_again(tmp_path: Path) -> None:
    class Key:  # its str() is not the same in another process
        def __repr__(self) -> str:
            return f"Key at {id(self):#x}"

        __str__ = __repr__

    state = {"a": {"b": torch.ones(1), 3: [torch.zeros(2)]}, "b.a": torch.ones(3)}
    skeleton = flatten({**state, "a.b": torch.full((1,), 2.0)})[SKELETON_KEY]
    assert skeleton["a"]["b"] is UNNAMED and skeleton["a"][3][0] is UNNAMED
    assert skeleton["a.b"] == TensorSlot("a.b#1")  # renamed: named
    assert flatten({"k": {Key(): torch.ones(1)}})[SKELETON_KEY]["k"].popitem()[1] != UNNAMED
    engine = DCPEngine()
    engine.save({**state, "a.b": torch.full((1,), 2.0)}, tmp_path / "c")
    loaded = engine.load(tmp_path / "c")
    assert torch.equal(loaded["a"]["b"], torch.ones(1)) and torch.equal(loaded["a.b"], torch.full((1,), 2.0))
    assert torch.equal(loaded["a"][3][0], torch.zeros(2)) and torch.equal(loaded["b.a"], torch.ones(3))
    engine.close()


def test_a_failed_file_fails_the_save_and_writes_no_marker(tmp_path: Path) -> None:
    engine = DCPEngine()
    path = tmp_path / "c"
    engine.save(_state(), path)
    (path / COMMIT_MARKER).unlink()
    os.remove(path / "__0_1.distcp")
    os.mkdir(path / "__0_1.distcp")  # the second file cannot be opened for writing
    with pytest.raises(CheckpointWriteError, match=str(path)):
        engine.save(_state(), path)
    assert not (path / COMMIT_MARKER).exists()
    with pytest.raises(CheckpointCorruptError, match="commit marker"):
        engine.load(path)
    engine.close()


def test_a_damaged_item_is_named_by_the_load_without_plan(tmp_path: Path) -> None:
    engine = DCPEngine()
    path = tmp_path / "c"
    engine.save(_state(), path)
    md = FileSystemReader(path).read_metadata()
    (index, info), = [(i, info) for i, info in md.storage_data.items() if i.fqn == "state_dict.w"]
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + 5)
        byte = f.read(1)
        f.seek(info.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match=r"fails its CRC32C check in 'state_dict\.w'"):
        engine.load(path)
    engine.close()


def test_whole_reads_needs_one_whole_chunk_into_a_matching_cpu_tensor(tmp_path: Path) -> None:
    engine = DCPEngine()
    engine.save({"w": torch.ones(4, 2)}, tmp_path / "c")
    md = FileSystemReader(tmp_path / "c").read_metadata()
    assert direct.whole_reads(md, {"w": torch.empty(4, 2), SKELETON_KEY: None}) is not None
    for dest in (torch.empty(8), torch.empty(4, 2, dtype=torch.float64), torch.empty(2, 4).t(), None,
                 torch.nn.Parameter(torch.empty(4, 2)), torch.empty(4, 2, device="meta"), torch.empty(4, 2).numpy()):
        assert direct.whole_reads(md, {"w": dest, SKELETON_KEY: None}) is None, dest
    for size in (8, 0):  # a storage shrunk or freed under its tensor: a read would write past it
        short = torch.empty(4, 2)
        short.untyped_storage().resize_(size)
        with pytest.raises(UsageError, match="'w' to load into holds fewer bytes than its shape needs"):
            direct.whole_reads(md, {"w": short, SKELETON_KEY: None})
        with pytest.raises(UsageError, match="'w' to load into holds fewer bytes"):  # not a damaged checkpoint
            engine.load(tmp_path / "c", template={"w": short})
    engine.save({"z": torch.randn(3, dtype=torch.complex64), "n": torch.ones(1)}, tmp_path / "z")
    md = FileSystemReader(tmp_path / "z").read_metadata()
    negated = torch.zeros(1, dtype=torch.complex64).conj().imag  # a lazily negated real view (contiguous: 1 element)
    assert negated.is_neg() and negated.is_contiguous()
    z, n = torch.empty(3, dtype=torch.complex64), torch.empty(1)
    assert direct.whole_reads(md, {"z": z, "n": n, SKELETON_KEY: None}) is not None
    assert direct.whole_reads(md, {"z": z.conj(), "n": n, SKELETON_KEY: None}) is None
    assert direct.whole_reads(md, {"z": z, "n": negated, SKELETON_KEY: None}) is None
    engine.close()


def test_async_saves_stage_into_buffers_made_once_per_layout(tmp_path: Path) -> None:
    engine = DCPEngine()
    state = _state()
    pointers = None
    for step in range(3):
        engine.save(state, tmp_path / f"c{step}", asynchronous=True)
        engine.wait_for_staging()
        expected = {k: v.clone() for k, v in state["state_dict"].items()}
        for tensor in state["state_dict"].values():
            tensor.add_(1) if tensor.dtype != torch.bool else None  # the next step changes the weights
        engine.wait()
        loaded = engine.load(tmp_path / f"c{step}")
        for key, tensor in expected.items():
            assert torch.equal(loaded["state_dict"][key], tensor), key
        now = {k: v.data_ptr() for k, v in engine.staging_buffers.items() if v.numel()}
        assert pointers is None or now == pointers  # the same host buffers every save
        pointers = now
    assert set(engine.staging_buffers) == set(flatten(state)) - {SKELETON_KEY}
    engine.close()
    assert engine.staging_buffers is None


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_saves_of_plain_tensors_are_staged_by_one_copy_as_they_were_at_the_save(tmp_path: Path,
                                                                                      monkeypatch, executor) -> None:
    """An async save whose tensors are all contiguous host tensors is staged by one call of the
    extension (:class:`~areal_lightning.write.direct.StagingCopy`, into this engine's buffers or
    the checkpoint process's segment): every dtype, 0-dim and empty
    tensors included, loads back as it was at the save although training changed it right
    after :meth:`wait_for_staging`; a save with a tensor that is not contiguous is staged by
    ``copy_`` per tensor; a tensor whose data was freed is named, and its save leaves no
    ``.metadata``."""
    calls: list[int] = []
    real = direct.StagingCopy.__call__

    def counted(self: Any, flat: Any) -> None:
        calls.append(len(self.keys))
        real(self, flat)

    monkeypatch.setattr(direct.StagingCopy, "__call__", counted)
    state = _state()
    transposed = state["state_dict"].pop("transposed")
    engine = DCPEngine(async_executor=executor)
    try:
        for step in range(4):
            if step == 3:
                state["state_dict"]["transposed"] = transposed  # not contiguous: copy_ per tensor
            engine.save(state, tmp_path / f"c{step}", asynchronous=True)
            engine.wait_for_staging()
            expected = {k: v.clone() for k, v in state["state_dict"].items()}
            expected["exp_avg"] = state["optimizer"]["state"][0]["exp_avg"].clone()
            for tensor in [*state["state_dict"].values(), state["optimizer"]["state"][0]["exp_avg"]]:
                tensor.add_(1)  # the next step changes every tensor
            engine.wait()
            loaded = engine.load(tmp_path / f"c{step}")
            for key, tensor in expected.items():
                got = loaded["optimizer"]["state"][0][key] if key == "exp_avg" else loaded["state_dict"][key]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
        tensors = len(flatten(state)) - 2  # the skeleton and the one not contiguous
        assert calls == ([tensors] * 3 if direct.STAGING_COPY else []), calls
        del state["state_dict"]["transposed"]
        engine.save(state, tmp_path / "alike", asynchronous=True)
        engine.wait()
        state["state_dict"]["w"].untyped_storage().resize_(0)  # its data freed; the check still finds it alike
        engine.save(state, tmp_path / "freed", asynchronous=True)
        if direct.STAGING_COPY:
            with pytest.raises(CheckpointWriteError, match=r"state_dict\.w\\?' has no storage to stage"):
                engine.wait()
            assert not (tmp_path / "freed" / ".metadata").exists()
    finally:
        try:
            engine.close()
        except CheckpointWriteError:
            pass


@pytest.fixture
def write_at_calls(monkeypatch) -> list[int]:
    """The item counts of the extension's ``write_at`` calls in this process (the extension
    itself, each call counted), from here on."""
    real, calls = direct.KERNEL, []

    class Counted:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def write_at(self, *args: Any) -> float:
            calls.append(len(args[1]))
            return real.write_at(*args)

    monkeypatch.setattr(direct, "KERNEL", Counted())
    return calls


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_saves_alike_take_their_signature_from_one_check_and_a_changed_tensor_is_saved_as_it_is(
        tmp_path: Path, executor: str, write_at_calls: list[int]) -> None:
    """An async save that needs no plan takes its layout's signature from one check of its
    tensors while they stay alike (new tensor objects, as ``state_dict()`` makes them, count as
    alike); a tensor whose shape, dtype or ``requires_grad`` changed under its key is saved with
    its new properties; every save loads back as it was. The thread executor writes its staging
    buffers from their addresses (``write_at``, where the extension has it), every tensor of
    every save; the process executor writes in its own process."""
    engine = DCPEngine(async_executor=executor)
    base = {f"w{i}": torch.full((4, 3), float(i)) for i in range(20)}
    changes = {"alike": lambda t: t.detach().clone(), "shape": lambda t: t.reshape(3, 4).clone(),
               "dtype": lambda t: t.double(), "requires_grad": lambda t: t.clone().requires_grad_()}
    try:
        order = ["alike", "alike", "shape", "shape", "dtype", "requires_grad", "requires_grad", "alike"]
        for step, change in enumerate(order):
            checks = engine._signatures.checks
            weights = {k: (changes[change](v) if k == "w5" else v.detach()) for k, v in base.items()}
            engine.save({"state_dict": weights, "step": step}, tmp_path / f"c{step}", asynchronous=True)
            engine.wait()
            taken = engine._signatures.checks > checks
            assert taken == (step > 0 and change == order[step - 1]), (step, change)  # alike the last save's
            loaded = engine.load(tmp_path / f"c{step}")
            assert loaded["step"] == step and list(loaded["state_dict"]) == list(weights)
            for key, tensor in weights.items():
                got = loaded["state_dict"][key]
                assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor.detach()), key
            md = FileSystemReader(tmp_path / f"c{step}").read_metadata().state_dict_metadata["state_dict.w5"]
            assert (tuple(md.size), md.properties.dtype, md.properties.requires_grad) == \
                (tuple(weights["w5"].shape), weights["w5"].dtype, weights["w5"].requires_grad)
    finally:
        engine.close()
    by_address = executor == "thread" and direct._ADDRESS_OF is not None
    assert sum(write_at_calls) == (len(base) * len(order) if by_address else 0)


def test_sync_saves_write_plain_tensors_from_their_addresses_and_others_as_they_are(tmp_path: Path,
                                                                                  write_at_calls: list[int]) -> None:
    """A sync save that needs no plan, on a host that cannot pin memory (none can be pinned),
    takes its signature from one check while its tensors stay alike, and writes contiguous
    host tensors from their addresses: one call of the extension per file (``write_at``), no
    Python object per tensor. A tensor made non-contiguous, or of another shape or dtype, is
    saved as it is by the per-tensor path; tensors of no elements after large ones (a group of
    no bytes) are written; every save loads back as it was; a tensor whose data was freed is
    named, and that save leaves no ``.metadata``."""
    if direct._ADDRESS_OF is None or pinning_possible():
        pytest.skip("needs the extension's write_at and torch's data_ptr function, on a host without an accelerator")
    calls = write_at_calls
    gen = torch.Generator().manual_seed(0)
    engine = DCPEngine()
    base = {"big0": torch.randn(300_000, generator=gen), "empty": torch.zeros(0, 3),
            "big1": torch.randn(200_000, generator=gen), **{f"w{i}": torch.full((4, 3), float(i)) for i in range(30)}}

    def strided(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape[::-1], dtype=t.dtype).t().copy_(t)  # same shape, not contiguous

    changes = {"alike": lambda t: t.detach().clone(), "strided": strided, "shape": lambda t: t.reshape(3, 4).clone(),
               "dtype": lambda t: t.double()}
    order = ["alike", "alike", "strided", "alike", "shape", "dtype", "dtype", "alike"]
    try:
        for step, change in enumerate(order):
            checks, before = engine._signatures.checks, len(calls)
            weights = {k: (changes[change](v) if k == "w5" else v.detach()) for k, v in base.items()}
            engine.save({"state_dict": weights, "step": step}, tmp_path / f"c{step}")
            assert (engine._signatures.checks > checks) == (step > 0 and change == order[step - 1]), (step, change)
            assert (len(calls) > before) == (change != "strided"), (step, change)  # from addresses: every plain save
            loaded = engine.load(tmp_path / f"c{step}")
            assert loaded["step"] == step and list(loaded["state_dict"]) == list(weights)
            for key, tensor in weights.items():
                got = loaded["state_dict"][key]
                assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), key
        assert sum(calls) == len(base) * (len(order) - order.count("strided"))  # every tensor of those saves
        ends = {"a": torch.randn(1 << 18, generator=gen), "b": torch.empty(0), "c": torch.randn(1 << 18, generator=gen),
                "d": torch.empty(0, 3)}  # b and d: a group of no bytes after a, in a's file
        engine.save({"state_dict": ends}, tmp_path / "ends")
        loaded = engine.load(tmp_path / "ends")["state_dict"]
        assert all(torch.equal(loaded[k], v) and loaded[k].shape == v.shape for k, v in ends.items())
        # the same alone in the second file, by the per-tensor path (a view that is not contiguous):
        # the last release failed this save with EIO
        square = torch.randn(480, 480, generator=gen)
        for last in ({"a": torch.randn(1 << 18, generator=gen), "c": torch.randn(230_000, generator=gen),
                      "b": torch.empty(0)},
                     {"a": square.t(), "c": torch.randn(230_000, generator=gen), "b": torch.empty(0)}):
            engine.save({"state_dict": last}, tmp_path / "last")
            loaded = engine.load(tmp_path / "last")["state_dict"]
            assert all(torch.equal(loaded[k], v) and loaded[k].shape == v.shape for k, v in last.items())
            engine.remove(tmp_path / "last")
        weights = {k: v.detach() for k, v in base.items()}
        engine.save({"state_dict": weights}, tmp_path / "alike")
        weights["w7"].untyped_storage().resize_(0)  # its data freed; the check still finds it alike
        with pytest.raises(CheckpointWriteError, match="'state_dict.w7' has no storage"):
            engine.save({"state_dict": weights}, tmp_path / "freed")
        assert not (tmp_path / "freed" / ".metadata").exists()
    finally:
        engine.close()
    flat = {SKELETON_KEY: {}, "a": torch.ones(2)}  # the skeleton first: the order the layout's places assume is not met
    assert direct.tensors_of(flat, plain=True).addresses(array("Q", [0]), array("Q", [8]), []) is None


def _save_into(path: Path, state: dict, layout: "direct.ByteLayout | None" = None,
               written: "direct.Written | None" = None) -> "direct.ByteLayout":
    flat = flatten(state)
    skeleton = direct.skeleton_bytes(flat.pop(SKELETON_KEY))
    layout = layout or direct.ByteLayout(direct.signature(flat, pinned=False), 2)
    path.mkdir(exist_ok=True)
    direct.save(direct.tensors_of(flat), skeleton, path, layout, written or direct.Written())
    return layout


# a training run's saves: each into a new folder beside the last (``.tmp-recover_checkpoint-{gen}``),
# names of every length a file system takes (255 bytes: a pickled str of one length byte) and
# not ASCII; or all into one folder (the memory tier's slots)
_SIBLINGS = [".tmp-recover_checkpoint-1", ".tmp-recover_checkpoint-10", "x", "é" * 127, "n" * 255,
             ".tmp-recover_checkpoint-11"]


@pytest.mark.parametrize("patch", ["extension", "indexed-copy"])
@pytest.mark.parametrize("folders", ["one", "siblings"])
def test_repeated_saves_write_metadata_from_its_pickle_made_once(tmp_path: Path, monkeypatch, patch,
                                                                 folders) -> None:
    """From the second save of a layout into the same folder (the memory tier's slots), or into
    a folder beside the last one's (a run's recover saves), ``.metadata`` is the layout's pickle
    with this save's checksums, skeleton length, save id and folder written in (the checksums by
    the extension's ``patch``, or by the indexed copy where it is not built): it unpickles (by
    Python's own unpickler, which checks every frame's length) to what pickling the ``Metadata``
    again gives, stock DCP's reader reads it, and our loader checks every item's checksum against
    the bytes; the manifest (its data files' part made once per layout) lists every file's size
    as written. Elsewhere (another parent folder) it is pickled again, then reused there."""
    from areal_lightning.write.checksum import ALGORITHM, ITEM_CHECKSUM, file_crc32c

    if patch == "extension" and direct._PATCH is None:
        pytest.skip("the compiled extension (with patch) is not built here")
    if patch == "indexed-copy":
        monkeypatch.setattr(direct, "_PATCH", None)
    engine = DCPEngine()
    layout = None
    steps = [(1, 0), (2, 40), (3, 7), (4, 7), (5, 0), (6, 3)]
    names = _SIBLINGS if folders == "siblings" else ["slot"] * len(steps)
    parents = [tmp_path] * 4 + [tmp_path / "elsewhere"] * 2
    for (step, grown), name, parent in zip(steps, names, parents):
        folder = parent / name
        folder.parent.mkdir(exist_ok=True)
        written = direct.Written()
        layout = _save_into(folder, _state(step, grown), layout, written)
        files = sorted(path for path in folder.iterdir())
        assert set(written.files) == {path.name for path in files}
        assert {name: entry["size"] for name, entry in written.files.items()} == \
            {path.name: path.stat().st_size for path in files}
        assert written.files[COMMIT_MARKER][ALGORITHM] == file_crc32c(folder / COMMIT_MARKER)
        assert (layout._pickled[2] is not None) == (step not in (1, 5))  # made at the second save in a parent
        ours = FileSystemReader(folder).read_metadata()
        strict = pickle._Unpickler(io.BytesIO((folder / COMMIT_MARKER).read_bytes())).load()
        fresh = pickle.loads(pickle.dumps(layout.metadata))
        assert ours.state_dict_metadata == fresh.state_dict_metadata == strict.state_dict_metadata
        assert ours.version == fresh.version == strict.version
        assert ours.storage_meta.checkpoint_id == strict.storage_meta.checkpoint_id == folder
        assert type(ours.storage_meta.checkpoint_id) is type(folder)
        assert (ours.storage_meta.checkpoint_id, ours.storage_meta.save_id) == \
            (fresh.storage_meta.checkpoint_id, fresh.storage_meta.save_id) != (folder, direct._SAVE_ID_SENTINEL)
        records = {index: (info.relative_path, info.offset, info.length, info.transform_descriptors,
                           getattr(info, ITEM_CHECKSUM)) for index, info in fresh.storage_data.items()}
        assert {index: (info.relative_path, info.offset, info.length, info.transform_descriptors,
                        getattr(info, ITEM_CHECKSUM)) for index, info in ours.storage_data.items()} == records
        loaded = engine.load(folder)  # every item's CRC32C checked as it is read
        expected = _state(step, grown)
        for key, tensor in expected["state_dict"].items():
            assert torch.equal(loaded["state_dict"][key], tensor)
        assert loaded["log"] == expected["log"]
    engine.close()
    # folders are told apart by their parents' parts (a Windows path compares without case)
    from pathlib import PureWindowsPath

    assert layout.pickled_for(PureWindowsPath("C:/T/a")) is None and layout.pickled_for(PureWindowsPath("c:/t/b")) is None
    assert layout._pickled[1] == 1 and direct._name_splices(PureWindowsPath("c:/t/b"))
    # a placeholder found twice in the pickle (here: a key holding the save id's): pickled as before
    state = _state()
    state["state_dict"][direct._SAVE_ID_SENTINEL] = torch.ones(2)
    layout = _save_into(tmp_path / "odd", state)
    _save_into(tmp_path / "odd", state, layout)
    assert layout._pickled[1] == 2 and layout._pickled[2] is None
    assert FileSystemReader(tmp_path / "odd").read_metadata().storage_meta.save_id != direct._SAVE_ID_SENTINEL


class Pair(NamedTuple):
    """A named tuple in a checkpoint (pickled by reference: a module-level class)."""

    x: Any
    y: Any


class Sub(dict):
    """A dict subclass in a checkpoint (picklable: at module level)."""


@pytest.mark.parametrize("bulk", [False, True, "remembered"], ids=["item-by-item", "dicts-whole", "dicts-whole-memo"])
def test_flatten_then_unflatten_gives_back_any_nesting_with_its_tensors_under_unique_keys(monkeypatch, bulk) -> None:
    """Any nesting of dicts (str, int and other keys, ``OrderedDict`` with attributes such as a
    state dict's ``_metadata``, a dict subclass), lists, tuples and named tuples, tensors and
    plain values, including keys that collide once dotted (``"a.b"`` beside ``{"a": {"b"}}``),
    the skeleton's own key, and one tensor in two places: every tensor under one key of its
    own, an unnamed slot exactly where the key is its dotted path, and the pickled skeleton
    filled again gives back the same structure with the same tensor objects. ``dicts-whole``:
    every dict is first tried as a whole (what dicts of 16 tensors or more are), and flatten
    gives exactly what it gives item by item: the same keys in the same order, the same
    skeleton, its dicts of the same types with the same attributes. ``dicts-whole-memo``: the
    same, through one memo kept over all examples (each call finds the paths the last states left
    there), and a second call with the memo this state left gives the same again."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from areal_lightning.write import dcp_format
    from areal_lightning.write.dcp_format import SlotUnpickler, unflatten

    def item_by_item(state: dict[str, Any]) -> dict[str, Any]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dcp_format, "_BULK", 1 << 62)
            return flatten(state)

    def with_attributes(d: dict[Any, Any]) -> OrderedDict:
        out = OrderedDict(d)
        out._metadata = {"": {"version": len(d)}}
        return out

    def attributes(obj: Any) -> Any:
        if isinstance(obj, dict):
            return (type(obj), getattr(obj, "__dict__", None), [(k, attributes(v)) for k, v in obj.items()])
        if isinstance(obj, (list, tuple)):
            return (type(obj), [attributes(v) for v in obj])
        return obj if isinstance(obj, torch.Tensor) else repr(obj)

    if bulk:
        monkeypatch.setattr(dcp_format, "_BULK", 1)
    memo: dict[str, Any] | None = {} if bulk == "remembered" else None

    pool = [torch.full((1,), float(i)) for i in range(6)]
    keys = st.sampled_from(["a", "b", "a.b", "b#1", "", "0", SKELETON_KEY, 0, 1, 2, (1, 2), 3.5])
    leaves = st.sampled_from(pool) | st.sampled_from([1, "s", None, 2.5, b"x"])
    trees = st.recursive(leaves, lambda inner: (
        st.dictionaries(keys, inner, max_size=4) | st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple) | st.tuples(inner, inner).map(lambda t: Pair(*t))
        | st.dictionaries(keys, inner, max_size=3).map(with_attributes)
        | st.dictionaries(keys, inner, max_size=3).map(Sub)), max_leaves=20)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return a is b
        if isinstance(a, dict):
            return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    def where(obj: Any, path: tuple[str, ...], by_path: bool) -> Iterator[tuple[Any, str, bool]]:
        if isinstance(obj, TensorSlot):
            yield obj, ".".join(path), by_path
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from where(v, (*path, str(k)), by_path and type(k) in (str, int))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from where(v, (*path, str(i)), by_path)

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(st.sampled_from(["a", "b", "a.b", "0", SKELETON_KEY, "a#1"]), trees, min_size=1, max_size=4))
    @example({"a.b": pool[0], "a": {"b": pool[1]}})  # a dict whose dotted key meets one taken before
    @example({"a": pool[0], SKELETON_KEY: pool[1]})  # a dict of tensors holding the skeleton's key
    @example({"state": {0: {"exp_avg": pool[0], "step": pool[1]}, 1: {}, "2": {"exp_avg": pool[2]}},  # per parameter
              "param_groups": [{"params": [0, 1, 2], "betas": (0.9, 0.99), "lr": 0.1, "name": None}]})
    @example({"s": {1: {"a": pool[0]}, "1": {"a": pool[1]}}})  # 1 and "1": two paths alike
    @example({"s": {"a": {"b.c": pool[0]}, "a.b": {"c": pool[1]}}})  # dotted keys: two paths alike
    @example({"s": {"a": {"b": pool[0]}}, "s.a": {"b": pool[1]}})  # a path taken before
    @example({"s": {0: {"x": pool[0], "y": 1}, 1: {"x": pool[1]}}, "t": {0: {"x": pool[0]}, (1, 2): {"x": pool[1]}}})
    def check(state: dict[str, Any]) -> None:
        flat = flatten(state, memo)
        if memo is not None:
            again = flatten(state, memo)
            assert list(again.items())[:-1] == list(flat.items())[:-1]
            assert attributes(again[SKELETON_KEY]) == attributes(flat[SKELETON_KEY])
        skeleton = flat.pop(SKELETON_KEY)
        named = []
        for slot, path, by_path in where(skeleton, (), True):
            if slot is UNNAMED:
                assert by_path, path
                named.append(path)
            else:
                assert slot.fqn and not (by_path and slot.fqn == path), (slot, path)
                named.append(slot.fqn)
        assert sorted(named) == sorted(flat) and SKELETON_KEY not in flat  # each tensor its own key
        if bulk:
            reference = item_by_item(state)
            assert list(flat.items()) == [(k, v) for k, v in reference.items() if k != SKELETON_KEY]
            assert attributes(skeleton) == attributes(reference[SKELETON_KEY])
        again = SlotUnpickler(io.BytesIO(pickle.dumps(skeleton))).load()
        assert same(unflatten(again, flat), state)

    check()


class _Key(str, enum.Enum):
    """A str subclass key (equal to its value): a state keyed by it is named by its ``str()``."""

    EXP_AVG = "exp_avg"


def test_flatten_with_a_memo_reuses_the_paths_of_a_dict_whose_keys_stay_and_only_those() -> None:
    """A state dict whose keys are the last one's, in order (new ``str`` objects, as
    ``state_dict()`` makes them), gets the same path objects back; reordered, renamed, one more
    or one less key, a key of another type: its paths are made again, exactly as without the memo."""
    tensors = [torch.full((1,), float(i)) for i in range(21)]
    sd = {f"l{i}.w": tensors[i] for i in range(20)}
    memo: dict[str, Any] = {}
    first = flatten({"m": sd, "n": 1}, memo)
    second = flatten({"m": {k[:1] + k[1:]: v for k, v in sd.items()}, "n": 1}, memo)
    assert list(second) == list(first) and all(a is b for a, b in zip(first, second) if a != SKELETON_KEY)
    renamed = {("l3.x" if k == "l3.w" else k): v for k, v in sd.items()}
    moved = OrderedDict(sd)
    moved.move_to_end("l3.w")  # its order no longer its underlying dict's
    moved.move_to_end("l0.w", last=False)
    for changed in (dict(reversed(sd.items())), renamed, {**sd, "l20.w": tensors[20]},
                    {k: v for k, v in sd.items() if k != "l19.w"}, {**sd, 5: tensors[20]}, OrderedDict(sd), moved):
        got = flatten({"m": changed, "n": 1}, memo)
        plain = flatten({"m": changed, "n": 1})
        assert list(got.items())[:-1] == list(plain.items())[:-1], changed.keys()
        assert type(got[SKELETON_KEY]["m"]) is type(changed) and list(got[SKELETON_KEY]["m"]) == list(changed)
        if 5 not in changed:  # taken whole: each tensor under its path, in the dict's own order
            assert [(k, v) for k, v in got.items() if k != SKELETON_KEY] == [(f"m.{k}", v) for k, v in changed.items()]
    # an optimizer's state per parameter: the same paths while its keys stay; changed, as without the memo
    per_parameter = {i: {"exp_avg": tensors[i], "step": tensors[20]} for i in range(20)}
    first = flatten({"state": per_parameter}, memo)
    second = flatten({"state": {i: dict(d) for i, d in per_parameter.items()}}, memo)
    assert list(second) == list(first) and all(a is b for a, b in zip(first, second) if a != SKELETON_KEY)
    assert second[SKELETON_KEY] == first[SKELETON_KEY] and second[SKELETON_KEY]["state"][0] is not \
        first[SKELETON_KEY]["state"][0]  # each save's skeleton its own
    def typed(obj: Any) -> Any:  # a skeleton with each dict key's type beside it (a str subclass equals its str)
        return [(type(k), k, typed(v)) for k, v in obj.items()] if isinstance(obj, dict) else obj

    keyed = {i: {_Key.EXP_AVG: d["exp_avg"], "step": d["step"]} for i, d in per_parameter.items()}  # equal keys
    for changed in ({**per_parameter, 20: {"exp_avg": tensors[0]}}, {**per_parameter, 3: {"exp_avg": tensors[3]}},
                    {**per_parameter, 3: {"exp_avg": tensors[3], "step": 1}}, {**per_parameter, "3": {"x": tensors[3]}},
                    dict(reversed(per_parameter.items())), {**per_parameter, 4: {"exp_avg": tensors[4], "s": tensors[5]}},
                    per_parameter, keyed, per_parameter, {**per_parameter, 7: {_Key.EXP_AVG: tensors[7]}}):
        got, plain = flatten({"state": changed}, memo), flatten({"state": changed})
        assert list(got.items())[:-1] == list(plain.items())[:-1]
        assert typed(got[SKELETON_KEY]) == typed(plain[SKELETON_KEY])
    # the memo keeps this call's dicts only: a prefix new at every save does not pile up
    for step in range(5):
        flatten({f"ema_{step}": sd, "m": sd}, memo)
        assert set(memo) == {f"ema_{step}.", "m."}
    flatten({"n": 1}, memo)
    assert memo == {}


@pytest.mark.parametrize("how", ["no-plan", "planned", "async", "async-planned", "memory-tier"])
def test_lazily_conjugated_and_negated_views_are_saved_and_loaded_as_the_values_they_show(tmp_path: Path,
                                                                                          how: str) -> None:
    """``z.conj()`` and ``z.conj().imag`` are views whose bytes are not their values (torch's
    conjugate and negative bits): a save must write the values (as stock DCP does), and a load
    into such a view must make it show the saved values. Through the save without planning,
    the planned one (a quantized tensor beside them), both asynchronous, and the memory tier's
    slot."""
    from areal_lightning.commit.memory_tier import MemoryTier
    from areal_lightning.config import MemoryConfig

    gen = torch.Generator().manual_seed(7)
    z, big = torch.randn(5, dtype=torch.complex64, generator=gen), torch.randn(70_000, dtype=torch.complex64, generator=gen)
    views = {"conj": z.conj(), "neg": z.conj().imag, "big_conj": big.conj(), "plain": torch.arange(4.0)}
    assert views["conj"].is_conj() and views["neg"].is_neg() and views["big_conj"].is_conj()
    state = {"state_dict": dict(views), "step": 3}
    planned = how.endswith("planned")
    if planned:
        state["state_dict"]["q"] = torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8)
    values = {k: v.resolve_conj().resolve_neg().clone() for k, v in views.items()}
    for key, view in [*views.items(), *((str(d), torch.quantize_per_tensor(torch.ones(2), 0.5, 0, d))
                                        for d in (torch.qint8, torch.quint8, torch.qint32))]:
        assert (direct.signature({key: view}) is None) == (key != "plain"), key  # DCP plans them
    engine = DCPEngine()
    try:
        if how == "memory-tier":
            tier = MemoryTier(MemoryConfig(enabled=True, root=str(tmp_path / "shm")).validate(), tmp_path / "tier", 0)
            tier.write(state, global_step=1, world_size=1, lineage=None, info={})
            tier.wait()
            [seal] = tier.held()
            path = seal.path
        else:
            engine.save(state, tmp_path / "c", asynchronous=how.startswith("async"))
            engine.wait()
            path = tmp_path / "c"
        plain = {"state_dict": {k: torch.zeros_like(v) for k, v in values.items()}}
        lazy = {"state_dict": {"conj": torch.zeros(5, dtype=torch.complex64).conj(),
                               "neg": torch.zeros(5, dtype=torch.complex64).conj().imag,
                               "big_conj": torch.zeros(70_000, dtype=torch.complex64).conj(),
                               "plain": torch.zeros(4)}}
        for template in (plain, lazy):
            if planned:
                template["state_dict"]["q"] = torch.quantize_per_tensor(torch.zeros(3), 0.5, 0, torch.qint8)
            loaded = engine.load(path, template=template)["state_dict"]
            for key, value in values.items():
                assert torch.equal(loaded[key], value), (key, template is lazy)
                assert loaded[key] is template["state_dict"][key]  # filled in place
    finally:
        engine.close()
        if how == "memory-tier":
            tier.close()


def test_signatures_refuse_a_flat_dict_that_still_holds_its_skeleton() -> None:
    """:class:`~areal_lightning.write.direct.Signatures` reads every value as a tensor: a flat dict
    with its skeleton is refused by name, not misread."""
    flat = flatten({"w": torch.ones(2)})
    from areal_lightning.errors import UsageError

    with pytest.raises(UsageError, match=SKELETON_KEY):
        direct.Signatures()(flat, pinned=False)
    flat.pop(SKELETON_KEY)
    assert direct.Signatures()(flat, pinned=False) == direct.signature(flat, pinned=False)
