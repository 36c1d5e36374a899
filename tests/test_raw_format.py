"""The on-disk layout of tensor items (0.2.0): raw bytes, read straight into the destination.

A tensor item is the tensor's row-major bytes, recorded with the transform descriptor
``areal.raw/1`` (which a stock DCP reader refuses by name); ``convert --to dcp`` writes the
stock layout. Earlier checkpoints (``torch.save`` items) still load: tests/test_format_compat.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from areal_lightning import convert
from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.write.dcp import DCPEngine
from areal_lightning.write.offline import tensor_entries
from areal_lightning.write.raw import RAW_DESCRIPTOR

REPO = Path(__file__).resolve().parents[1]


def _state() -> dict:
    torch.manual_seed(0)
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    return {
        "state_dict": {
            "w": torch.randn(64, 32),
            "bf16": torch.randn(8, 8).to(torch.bfloat16),
            "half": torch.randn(5).half(),
            "ids": torch.arange(10, dtype=torch.int64),
            "mask": torch.rand(7) > 0.5,
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "transposed": torch.randn(6, 3).t(),  # not contiguous
            "conv": conv,  # channels_last
            "slice": torch.randn(10, 4)[2:5],  # a view with a storage offset
            "cplx": torch.randn(3, dtype=torch.complex64),
        },
        "step": 7,
    }


def test_tensor_items_are_their_raw_bytes_and_load_in_place(tmp_path: Path) -> None:
    state, path = _state(), tmp_path / "ckpt"
    engine = DCPEngine()
    engine.save(state, path)
    md = FileSystemReader(path).read_metadata()
    tensors = {index.fqn: info for index, info in md.storage_data.items() if index.fqn.startswith("state_dict.")}
    assert set(tensors) == {f"state_dict.{k}" for k in state["state_dict"]}
    for fqn, info in tensors.items():
        tensor = state["state_dict"][fqn.split(".", 1)[1]]
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            stored = f.read(info.length)
        assert info.transform_descriptors == [RAW_DESCRIPTOR], fqn
        assert stored == tensor.contiguous().numpy().tobytes() if tensor.dtype != torch.bfloat16 else \
            stored == tensor.contiguous().view(torch.int16).numpy().tobytes(), fqn  # exactly its bytes, no container

    # into a template: each contiguous destination is filled in place (no second buffer)
    template = {"state_dict": {k: torch.full_like(v, 0) for k, v in state["state_dict"].items()}}
    pointers = {k: v.data_ptr() for k, v in template["state_dict"].items()}
    loaded = engine.load(path, template=template)
    assert loaded["step"] == 7
    for key, tensor in state["state_dict"].items():
        got = loaded["state_dict"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), key
        if template["state_dict"][key].is_contiguous() and tensor.numel():
            assert got.data_ptr() == pointers[key], key
    # without a template: allocated from the metadata
    fresh = engine.load(path)
    for key, tensor in state["state_dict"].items():
        assert torch.equal(fresh["state_dict"][key], tensor) and fresh["state_dict"][key].dtype == tensor.dtype, key
    assert engine.last_read.verified == sum(1 for info in md.storage_data.values() if info.length)  # DCP reads
    engine.close()  # no item for an empty tensor


def test_a_stock_dcp_load_refuses_the_raw_layout_by_name_and_reads_its_stock_copy(tmp_path: Path) -> None:
    state, path = _state(), tmp_path / "ckpt"
    DCPEngine().save(state, path)
    flat = {fqn: torch.empty(size, dtype=dtype) for fqn, (size, dtype) in tensor_entries(path).items()}
    with pytest.raises(CheckpointException, match="Unknown extension name='areal.raw'"):
        dcp.load(dict(flat), checkpoint_id=path, no_dist=True)

    cli = subprocess.run([sys.executable, "-m", "areal_lightning", "convert", str(path), "--to", "dcp",
                          "--out", str(tmp_path / "stock")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip() == str(tmp_path / "stock")
    md = FileSystemReader(tmp_path / "stock").read_metadata()
    assert not any(info.transform_descriptors for info in md.storage_data.values())
    dcp.load(flat, checkpoint_id=tmp_path / "stock", no_dist=True)  # torch's own reader, its own planner
    for key, tensor in state["state_dict"].items():
        assert torch.equal(flat[f"state_dict.{key}"], tensor), key
    engine = DCPEngine()
    again = engine.load(tmp_path / "stock")  # and ours, every item verified
    read = [index for index in md.storage_data if index.fqn != "state_dict.empty"]  # DCP reads no empty tensor
    assert again["step"] == 7 and engine.last_read.verified == len(read)
    for key, tensor in state["state_dict"].items():
        assert torch.equal(again["state_dict"][key], tensor), key

    # a damaged source: named, and nothing is left at the output
    name = next(info.relative_path for info in FileSystemReader(path).read_metadata().storage_data.values()
                if info.length > 1000)
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 1
    (path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="fails its CRC32C check"):
        convert(path, "dcp", tmp_path / "stock2")
    assert not (tmp_path / "stock2").exists() and [p.name for p in tmp_path.iterdir() if "stock2" in p.name] == []
    assert (path / COMMIT_MARKER).is_file()


def test_a_partial_read_of_a_saved_chunk_is_narrowed(tmp_path: Path) -> None:
    """A template slot that is not the whole contiguous chunk (here a transposed view) is read
    through a scratch tensor and copied."""
    path = tmp_path / "ckpt"
    w = torch.randn(6, 3)
    DCPEngine().save({"w": w}, path)
    dest = torch.zeros(3, 6).t()
    loaded = DCPEngine().load(path, template={"w": dest})
    assert torch.equal(dest, w) and loaded["w"] is dest


def test_a_quantized_tensor_stays_a_torch_save_item_and_round_trips(tmp_path: Path) -> None:
    """Tensors that have no plain byte layout (quantized here) are written as DCP writes them."""
    q = torch.quantize_per_tensor(torch.randn(4, 4), scale=0.1, zero_point=3, dtype=torch.qint8)
    path = tmp_path / "ckpt"
    DCPEngine().save({"q": q, "w": torch.ones(3)}, path)
    infos = {index.fqn: info for index, info in FileSystemReader(path).read_metadata().storage_data.items()}
    assert infos["q"].transform_descriptors is None and infos["w"].transform_descriptors == [RAW_DESCRIPTOR]
    loaded = DCPEngine().load(path)
    assert loaded["q"].is_quantized and torch.equal(loaded["q"].int_repr(), q.int_repr())
    assert loaded["q"].q_scale() == q.q_scale() and torch.equal(loaded["w"], torch.ones(3))
