"""Tests of areal_lightning.write.dcp and areal_lightning.stage: format round trip, async rules, failures, memory."""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areal_lightning.errors import CheckpointCorruptError, CheckpointWriteError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.stage import BackgroundWorker
from areal_lightning.write import dcp_writer as writer_mod
from areal_lightning.write import direct
from areal_lightning.write.dcp import DCPEngine

Point = collections.namedtuple("Point", "x y")


class Opaque:
    """A non-container leaf: stored through the skeleton pickle."""

    def __init__(self, value: int) -> None:
        self.value = value


def _trained_adam(seed: int = 0, hidden: int = 8) -> tuple[torch.nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "misc": {
            7: torch.arange(3),
            "empty": {},
            "empty_list": [],
            "tuple": (1, torch.ones(2)),
            "named": Point(1, torch.zeros(2)),
            "ordered": collections.OrderedDict(b=1, a=2),
            "opaque": Opaque(5),
        },
        "global_step": 42,
        "version": "2.6.6",
    }


def _assert_same(a: object, b: object) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, Opaque):
        assert a.value == b.value
    else:
        assert a == b


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_round_trip_keeps_structure_key_types_and_adam_moments(tmp_path: Path, asynchronous: bool) -> None:
    model, opt = _trained_adam()
    state = _state(model, opt)
    eng = DCPEngine()
    eng.save(state, tmp_path / "ckpt", asynchronous=asynchronous)
    eng.wait()
    assert (tmp_path / "ckpt" / COMMIT_MARKER).is_file()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("__0_*.distcp"))

    loaded = eng.load(tmp_path / "ckpt", weights_only=False)
    _assert_same(state, loaded)
    moments = loaded["optimizer_states"][0]["state"]
    assert set(moments) == {0, 1, 2, 3}  # integer keys survive
    for idx, param in enumerate(model.parameters()):
        assert torch.equal(moments[idx]["exp_avg"], opt.state[param]["exp_avg"])
        assert torch.equal(moments[idx]["exp_avg_sq"], opt.state[param]["exp_avg_sq"])

    # Optimizer.load_state_dict keeps the moments (it silently drops string-keyed ones).
    _, fresh = _trained_adam(seed=1)
    fresh.load_state_dict(loaded["optimizer_states"][0])
    for param_fresh, param in zip(fresh.param_groups[0]["params"], model.parameters()):
        assert torch.equal(fresh.state[param_fresh]["exp_avg"], opt.state[param]["exp_avg"])
    eng.close()


def test_load_into_caller_template_in_place(tmp_path: Path) -> None:
    model, opt = _trained_adam()
    eng = DCPEngine()
    eng.save(_state(model, opt), tmp_path / "ckpt")
    target = torch.zeros_like(model.state_dict()["0.weight"])
    loaded = eng.load(tmp_path / "ckpt", template={"state_dict": {"0.weight": target}}, weights_only=False)
    assert loaded["state_dict"]["0.weight"] is target
    assert torch.equal(target, model.state_dict()["0.weight"])


def test_weights_only_applies_to_the_skeleton(tmp_path: Path) -> None:
    model, opt = _trained_adam()
    eng = DCPEngine()
    eng.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, tmp_path / "plain")
    assert eng.load(tmp_path / "plain", weights_only=True)["step"] == 3
    eng.save({"opaque": Opaque(1)}, tmp_path / "custom")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        eng.load(tmp_path / "custom", weights_only=True)



class _Touch:
    """Unpickled, it creates a file (what a malicious pickle would do instead)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


ran: list = []


def _ran(value) -> None:
    """Called by an unpickled extension code (see the plain-skeleton test)."""
    ran.append(value)


def _zipped(records: dict) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, value in records.items():
            archive.writestr(name, value)
    return buffer.getvalue()


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (an OrderedDict's attributes too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a) and vars(a) == vars(b) \
            if isinstance(a, collections.OrderedDict) else list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_plain_skeleton_loads_by_the_compiled_unpickler_as_torch_load_would(tmp_path: Path, monkeypatch) -> None:
    """``load_plain`` (the skeleton of a weights-only load): what ``torch.load(weights_only=True)``
    gives, for every builtin value and type it allows; anything else -- a tensor (a persistent
    id), a class or function it does not know, a callable that would run, damaged or foreign
    bytes -- is left to ``torch.load`` (``NOT_PLAIN``) without being run; and a load of a plain
    skeleton does not call ``torch.load`` at all."""
    from areal_lightning.write.dcp_format import NOT_PLAIN, UNNAMED, TensorSlot, load_plain, slot_globals

    metadata = collections.OrderedDict(w=1)
    metadata._metadata = {"": {"version": 1}}
    plain = [
        {"a": 1, "b": [1.5, -2, None, True, "x" * 300, b"\x00\xff" * 40], "c": (1, (2, 3)), 4: {}, (5, 6): []},
        metadata, collections.Counter("abracadabra"), {1, 2, "three"}, bytearray(b"\x01\x02"),
        complex(1, -2), float("inf"), [UNNAMED, TensorSlot("opt.state.0.exp_avg"), UNNAMED],
        {"state_dict": dict.fromkeys([f"layer{i}.weight" for i in range(50)], UNNAMED), "step": 7},
        [[[[{"deep": 1}]]]], "", 2 ** 80,
    ]
    for obj in plain:
        data = _saved(obj)
        with torch.serialization.safe_globals(slot_globals()):
            expected = torch.load(io.BytesIO(data), weights_only=True)
        assert _same(load_plain(data), expected), obj
    marker = tmp_path / "ran"
    others = [{"t": torch.ones(2)}, Point(1, 2), Opaque(3), _Touch(marker), torch.float32, torch.Size([2]),
              collections.defaultdict(list), frozenset({4})]  # (frozenset: weights_only refuses it)
    for obj in others:
        assert load_plain(_saved(obj)) is NOT_PLAIN, obj
    assert not marker.exists()
    data = _saved({"a": 1})
    assert load_plain(data[: len(data) // 2]) is NOT_PLAIN and load_plain(b"not a zip") is NOT_PLAIN
    # an archive torch's reader refuses: no version record, or records outside the first one's folder
    pickled = pickle.dumps({"a": 1}, protocol=2)
    for records in ({"archive/data.pkl": pickled}, {"a/version": b"3\n", "b/data.pkl": pickled},
                    {"archive/version": b"3\n", "archive/data.pkl": pickled, "other/x": b""}):
        assert load_plain(_zipped(records)) is NOT_PLAIN, records
    assert load_plain(_zipped({"archive/version": b"3\n", "archive/data.pkl": pickled})) == {"a": 1}
    # an extension code (copyreg) resolved from Python's cache, without find_class: not run
    ran.clear()
    code = 0x7A5E
    evil = b"\x80\x02\x84" + code.to_bytes(4, "little") + b"X\x01\x00\x00\x00x\x85R."
    copyreg.add_extension(__name__, "_ran", code)
    try:
        pickle.loads(evil)  # some code of the process used the extension once: it is cached now
        assert ran == ["x"]
        ran.clear()
        assert load_plain(_zipped({"archive/version": b"3\n", "archive/data.pkl": evil})) is NOT_PLAIN
        assert not ran
    finally:
        copyreg.remove_extension(__name__, "_ran", code)
    at = data.index(b"\x80\x02")  # data.pkl's start (stored, not compressed): a damaged opcode
    assert load_plain(data[:at + 2] + b"\xff" + data[at + 3:]) is NOT_PLAIN
    # in a load: a plain skeleton never reaches torch.load
    model, opt = _trained_adam()
    eng = DCPEngine()
    eng.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
              "meta": {"names": {"a", "b"}, "blob": b"xyz"}}, tmp_path / "plain")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    loaded = eng.load(tmp_path / "plain", weights_only=True)
    assert loaded["step"] == 3 and loaded["meta"] == {"names": {"a", "b"}, "blob": b"xyz"}
    assert _same(loaded["optimizer"]["param_groups"], opt.state_dict()["param_groups"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


class _Holder:
    """A non-container leaf that holds a tensor (its storage reached through its ``__dict__``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_skeleton_is_saved_as_torch_save_saves_it(tmp_path: Path, monkeypatch) -> None:
    """``save_skeleton`` (every save's skeleton): the archive ``torch.save`` writes, record for
    record (all but the random serialization id), for builtin values, the types torch allows
    and any others; one that holds a storage anywhere (a tensor, a storage, an object holding a
    tensor) goes to ``torch.save`` whole, its storages as records; what cannot be pickled fails
    as ``torch.save`` fails."""
    from areal_lightning.write import dcp_format
    from areal_lightning.write.dcp_format import UNNAMED, TensorSlot, save_skeleton

    def records(data: bytes) -> dict[str, bytes]:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return {name: archive.read(name) for name in archive.namelist() if not name.endswith("serialization_id")}

    def ours(obj) -> bytes:
        buffer = io.BytesIO()
        save_skeleton(obj, buffer)
        return buffer.getvalue()

    metadata = collections.OrderedDict(w=1)
    metadata._metadata = {"": {"version": 1}}
    shared = [1, 2]
    plain = [
        {"a": 1, "b": [1.5, -2, None, True, "x" * 300, b"\x00\xff" * 40], "c": (1, (2, 3)), 4: {}, (5, 6): []},
        metadata, collections.Counter("abracadabra"), {1, 2, "three"}, bytearray(b"\x01\x02"), complex(1, -2),
        [UNNAMED, TensorSlot("opt.state.0.exp_avg"), UNNAMED], {"x": shared, "y": shared},
        {"state_dict": dict.fromkeys([f"layer{i}.weight" for i in range(50)], UNNAMED), "step": 7},
        Point(1, 2), Opaque(3), _Touch(tmp_path / "never"), torch.float32, torch.Size([2, 3]), torch.device("cpu"),
        collections.defaultdict(list, a=[1]), frozenset({4}), _Holder, 2 ** 80, "",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        typed = torch.ones(2).storage()
    storages = [{"t": torch.ones(2)}, [Opaque(1), _Holder(torch.arange(3))], torch.ones(3).untyped_storage(),
                {"typed": typed}]
    real_save, modules = torch.save, []

    def save(*args, **kwargs):  # torch.save itself, what it is asked to pickle by noted
        modules.append(kwargs.get("pickle_module"))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    for obj in plain + storages:
        modules.clear()
        got = ours(obj)
        assert modules == [dcp_format._Pickled if any(obj is p for p in plain) else None], obj  # pickled before, or not
        monkeypatch.setattr(torch, "save", real_save)
        assert records(got) == records(_saved(obj)), obj
        monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(torch, "save", real_save)
    with pytest.raises(Exception) as theirs:
        _saved({"f": lambda: 1})
    with pytest.raises(type(theirs.value)):
        ours({"f": lambda: 1})


def test_async_returns_snapshot_not_later_mutations(tmp_path: Path) -> None:
    weights = torch.ones(1000)
    eng = DCPEngine()
    eng.save({"w": weights, "meta": {"n": 1}}, tmp_path / "ckpt", asynchronous=True)
    eng.wait_for_staging()
    weights.add_(1)  # the training step after staging
    eng.wait()
    assert torch.equal(eng.load(tmp_path / "ckpt")["w"], torch.ones(1000))


def _gate_commit(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every commit (our own writer's finish) until the returned event is set."""
    gate = threading.Event()
    original, direct_commit = writer_mod.HashingWriter.finish, direct.write_metadata

    def gated_finish(self, metadata, results):  # type: ignore[no-untyped-def]
        assert gate.wait(30), "test gate never opened"
        original(self, metadata, results)

    def gated_commit(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(30), "test gate never opened"
        direct_commit(*args, **kwargs)

    monkeypatch.setattr(writer_mod.HashingWriter, "finish", gated_finish)  # saves DCP plans
    monkeypatch.setattr(direct, "write_metadata", gated_commit)  # saves that need no plan
    return gate


def _waits_for_a_save_in_flight(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when another thread starts waiting for an unfinished save (``BackgroundWorker.join``
    with a job in flight): with the commit gated, that thread then stays in the wait."""
    entered = threading.Event()
    original, caller = BackgroundWorker.join, threading.get_ident()

    def join(self: BackgroundWorker) -> None:
        if self.in_flight is not None and threading.get_ident() != caller:
            entered.set()
        original(self)

    monkeypatch.setattr(BackgroundWorker, "join", join)
    return entered


def test_second_async_save_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _gate_commit(monkeypatch)
    eng = DCPEngine()
    state = {"w": torch.randn(64)}
    eng.save(state, tmp_path / "a", asynchronous=True)
    assert eng.in_flight == str(tmp_path / "a")

    waiting = _waits_for_a_save_in_flight(monkeypatch)
    second = threading.Thread(target=eng.save, args=(state, tmp_path / "b"), kwargs={"asynchronous": True})
    second.start()
    assert waiting.wait(30), "second save did not wait for the first"
    assert second.is_alive()
    assert not (tmp_path / "b").exists()
    gate.set()
    second.join(30)
    assert (tmp_path / "a" / COMMIT_MARKER).is_file()
    eng.wait()
    assert (tmp_path / "b" / COMMIT_MARKER).is_file()


def test_remove_of_in_flight_path_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _gate_commit(monkeypatch)
    eng = DCPEngine()
    eng.save({"w": torch.randn(64)}, tmp_path / "a", asynchronous=True)
    waiting = _waits_for_a_save_in_flight(monkeypatch)
    remover = threading.Thread(target=eng.remove, args=(tmp_path / "a",))
    remover.start()
    assert waiting.wait(30), "the removal did not wait for the save in flight"
    assert remover.is_alive() and (tmp_path / "a").exists()
    gate.set()
    remover.join(30)
    assert not (tmp_path / "a").exists()
    eng.close()


def test_injected_failure_surfaces_on_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = DCPEngine()
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    eng.save({"w": torch.ones(8)}, tmp_path / "bad", asynchronous=True)
    with pytest.raises(CheckpointWriteError, match=str(tmp_path / "bad")) as info:
        eng.save({"w": torch.ones(8)}, tmp_path / "next", asynchronous=True)
    assert "InjectedFault" in str(info.value)
    assert not (tmp_path / "next").exists()  # the failing call did not start a new save
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    with pytest.raises(CheckpointCorruptError, match="commit marker"):
        eng.load(tmp_path / "bad")
    # Raised once: the engine keeps working afterwards.
    eng.save({"w": torch.ones(8)}, tmp_path / "next", asynchronous=True)
    eng.close()
    assert (tmp_path / "next" / COMMIT_MARKER).is_file()


def test_injected_failure_surfaces_at_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = DCPEngine()
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.after_staging")
    eng.save({"w": torch.ones(8)}, tmp_path / "bad", asynchronous=True)
    with pytest.raises(CheckpointWriteError, match=str(tmp_path / "bad")):
        eng.close()


def test_sync_failure_raises_with_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    with pytest.raises(CheckpointWriteError, match=str(tmp_path / "bad")):
        DCPEngine().save({"w": torch.ones(8)}, tmp_path / "bad")


def test_overwrite_withdraws_old_marker_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = DCPEngine()
    eng.save({"w": torch.ones(8)}, tmp_path / "ckpt")
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    with pytest.raises(CheckpointWriteError):
        eng.save({"w": torch.zeros(8)}, tmp_path / "ckpt")
    # Old marker over half-new data would load garbage; instead the directory is refused.
    with pytest.raises(CheckpointCorruptError, match=str(tmp_path / "ckpt")):
        eng.load(tmp_path / "ckpt")


def test_missing_marker_and_wrong_paths_are_refused(tmp_path: Path) -> None:
    eng = DCPEngine()
    eng.save({"w": torch.ones(8)}, tmp_path / "ckpt")
    (tmp_path / "ckpt" / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointCorruptError, match=rf"{tmp_path / 'ckpt'} has no \.metadata commit marker"):
        eng.load(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        eng.load(tmp_path / "nowhere")
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointCorruptError, match="is a file"):
        eng.load(tmp_path / "file.ckpt")
    with pytest.raises(FileExistsError, match="file.ckpt"):
        eng.save({"w": torch.ones(1)}, tmp_path / "file.ckpt")


def test_foreign_dcp_checkpoint_is_explained(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    with pytest.raises(CheckpointCorruptError, match="not written by areal_lightning"):
        DCPEngine().load(tmp_path / "foreign")


def test_thread_count_validated() -> None:
    with pytest.raises(ValueError, match="thread_count"):
        DCPEngine(thread_count=0)


def _vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_fifty_async_saves_keep_rss_flat(tmp_path: Path) -> None:
    """Staging buffers are reused: 50 saves of a 6 MiB state (weights + Adam moments)
    grow RSS by less than 10% of the warm RSS + 8 MiB; a leak would add 6 MiB per save."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.Adam(model.parameters())
    eng = DCPEngine()

    def cycle() -> None:
        opt.zero_grad()
        model(torch.randn(4, 1024)).sum().backward()
        eng.wait_for_staging()
        opt.step()
        eng.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt", asynchronous=True)

    for _ in range(5):
        cycle()
    eng.wait()
    warm = _vm_rss_bytes()
    for _ in range(50):
        cycle()
    eng.wait()
    grown = _vm_rss_bytes() - warm
    assert grown < 0.10 * warm + 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 50 saves (warm {warm / 2**20:.0f} MiB)"
    eng.close()


def test_background_worker_rules(tmp_path: Path) -> None:
    worker = BackgroundWorker("test")
    src = {"w": torch.arange(6, dtype=torch.float32)}
    staged = worker.stage_to_host(src)
    src["w"].add_(100)  # a later training step
    assert torch.equal(staged["w"], torch.arange(6, dtype=torch.float32))
    assert staged["w"].data_ptr() != src["w"].data_ptr()
    again = worker.stage_to_host(src)
    assert again["w"].data_ptr() == staged["w"].data_ptr()  # buffers reused

    done = []
    worker.submit(lambda: done.append(1), label="job-1")
    worker.wait()
    assert done == [1]

    def fail() -> None:
        raise OSError("disk full")

    worker.submit(fail, label=str(tmp_path / "export"))
    with pytest.raises(CheckpointWriteError, match="export.*disk full"):
        worker.submit(lambda: None, label="job-3")
    worker.submit(fail, label="job-4")
    worker.join()  # keeps the failure
    with pytest.raises(CheckpointWriteError, match="job-4"):
        worker.raise_if_failed()
    worker.raise_if_failed()  # raised once
    worker.submit(fail, label="job-5")
    with pytest.raises(CheckpointWriteError, match="job-5"):
        worker.close()


def test_rank_local_save_under_a_process_group(tmp_path: Path) -> None:
    """With a process group initialized, rank-local calls use no_dist (no collective hang)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        eng = DCPEngine()
        eng.save({"w": torch.ones(4), "step": 1}, tmp_path / "ckpt", asynchronous=True)
        eng.wait()
        assert eng.load(tmp_path / "ckpt")["step"] == 1
        eng.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned-memory staging")
def test_cuda_pinned_staging_and_async_round_trip(tmp_path: Path) -> None:
    worker = BackgroundWorker("cuda")
    src = {"w": torch.randn(1 << 20, device="cuda")}
    staged = worker.stage_to_host(src)
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], src["w"].cpu())
    worker.close()

    eng = DCPEngine()
    eng.save({"w": src["w"], "step": 2}, tmp_path / "ckpt", asynchronous=True)
    eng.wait_for_staging()
    expected = src["w"].cpu()
    src["w"].add_(1)
    eng.wait()
    assert torch.equal(eng.load(tmp_path / "ckpt")["w"], expected)
    eng.close()


def test_another_engine_loading_an_in_flight_path_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. `trainer.save_checkpoint` (async) then a new Trainer's `fit(ckpt_path=...)` in the same process."""
    gate = _gate_commit(monkeypatch)
    writer, reader = DCPEngine(), DCPEngine()
    writer.save({"w": torch.arange(8.0)}, tmp_path / "a", asynchronous=True)
    result: dict = {}
    waiting = _waits_for_a_save_in_flight(monkeypatch)
    loader = threading.Thread(target=lambda: result.update(reader.load(tmp_path / "a")))
    loader.start()
    assert waiting.wait(30), "the load did not wait for the save in flight"
    assert loader.is_alive()
    gate.set()
    loader.join(30)
    assert torch.equal(result["w"], torch.arange(8.0))
    writer.close()


# -- integrity: per-item CRC32C where the bytes are ---------------------------------------------


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _big_state() -> dict:
    torch.manual_seed(0)
    model, opt = _trained_adam(hidden=512)
    return {"state_dict": {**model.state_dict(), "big": torch.randn(1 << 20)}, "optimizer": opt.state_dict(),
            "epoch": 3}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_save_reads_nothing_and_records_every_items_crc_in_the_metadata(tmp_path: Path, asynchronous: bool) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from areal_lightning.write.checksum import ITEM_CHECKSUM, crc32c, file_crc32c

    engine, state, path = DCPEngine(), _big_state(), tmp_path / "ckpt"
    published = []
    before = _rchar()
    engine.save(state, path, asynchronous=asynchronous, then=published.append)
    engine.wait()
    read = _rchar() - before
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert sum(files.values()) > 4 << 20 and read < 256 << 10, (read, files)  # nothing was read back
    (written,) = published
    assert written is engine.last_written and written.unhashed == 0 and written.items > 10
    assert written.nbytes == sum(files.values()) and written.hash_s > 0
    assert {k: v["size"] for k, v in written.files.items()} == files
    assert written.files[COMMIT_MARKER]["crc32c"] == file_crc32c(path / COMMIT_MARKER)
    md = FileSystemReader(path).read_metadata()
    for index, info in md.storage_data.items():  # each item's CRC is the CRC of exactly its bytes
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            assert getattr(info, ITEM_CHECKSUM) == crc32c(f.read(info.length)), index.fqn
    before = _rchar()
    loaded = engine.load(path)
    read = _rchar() - before
    data = sum(size for name, size in files.items() if name != COMMIT_MARKER)
    assert data <= read <= data + 2 * files[COMMIT_MARKER] + (256 << 10)  # every byte read once
    assert engine.last_read.nbytes == data and engine.last_read.verified == len(md.storage_data)
    assert torch.equal(loaded["state_dict"]["big"], state["state_dict"]["big"])
    data_files = {info.relative_path for info in md.storage_data.values()}
    with engine.checked_before(str(path), data_files):  # the caller checked them just before (a memory-tier slot)
        again = engine.load(path)
    assert engine.last_read.nbytes == data and engine.last_read.verified == 0 and engine.last_read.verify_s == 0
    assert torch.equal(again["state_dict"]["big"], state["state_dict"]["big"])
    first = sorted(data_files)[0]
    with engine.checked_before(path, {first}):  # the other files' items are checked
        engine.load(path)
    assert engine.last_read.verified == sum(info.relative_path != first for info in md.storage_data.values()) > 0
    engine.load(path)  # only within, only that path
    assert engine.last_read.verified == len(md.storage_data)
    engine.close()


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass-read", "read-then-crc32c"])
def test_a_flipped_byte_anywhere_is_caught_at_load_naming_file_and_key(tmp_path: Path, monkeypatch, one_pass) -> None:
    """Both writers and readers of a save and load without plan: the compiled one-pass ones
    (each part checksummed as written or read) and the Python ones (without the extension)."""
    from torch.distributed.checkpoint import FileSystemReader

    from areal_lightning.commit.manifest import verify_files
    from areal_lightning.write import dcp_reader
    from areal_lightning.write.dcp_format import SKELETON_KEY, flat_tensors

    assert dcp_reader.ONE_PASS_READ or not one_pass, "the compiled _crc32c_copy is not built (see test_slot_copy.py)"
    monkeypatch.setattr(dcp_reader, "ONE_PASS_READ", one_pass)
    monkeypatch.setattr(direct, "ONE_PASS_WRITE", one_pass)
    calls = []
    batch = dcp_reader.AdoptingReader._read_batch
    monkeypatch.setattr(dcp_reader.AdoptingReader, "_read_batch", lambda *a: calls.append(1) or batch(*a))

    engine, path = DCPEngine(), tmp_path / "ckpt"
    state = _big_state()
    engine.save(state, path)
    back, saved = flat_tensors(engine.load(path)), flat_tensors(state)
    assert back.keys() == saved.keys() and all(torch.equal(back[k], v) for k, v in saved.items())
    md = FileSystemReader(path).read_metadata()
    items = sorted(((info.relative_path, info.offset, info.length, index.fqn) for index, info in md.storage_data.items()))
    for name, offset, length, key in items[:: max(1, len(items) // 7)] + items[-1:]:
        for at in (offset, offset + length // 2, offset + length - 1):  # headers, data, the item's last byte
            shard = path / name
            pristine = shard.read_bytes()
            damaged = bytearray(pristine)
            damaged[at] ^= 0x40
            shard.write_bytes(bytes(damaged))
            with pytest.raises(CheckpointCorruptError, match=f"{shard} fails its CRC32C check in {key!r}"):
                engine.load(path)
            with pytest.raises(CheckpointCorruptError, match=f"{shard} fails its CRC32C check in {key!r}"):
                verify_files(path, "restore it")
            shard.write_bytes(pristine)
    # a .metadata whose recorded length of an item is not its tensor's size: refused by name
    pristine_md = (path / ".metadata").read_bytes()
    name, _, length, key = next(item for item in items if item[3] != SKELETON_KEY and item[2] > 4)
    for recorded in (length - 4, -4):  # short, and no byte count at all
        damaged_md = FileSystemReader(path).read_metadata()
        for index, info in damaged_md.storage_data.items():
            if index.fqn == key:
                info.length = recorded
        (path / ".metadata").write_bytes(pickle.dumps(damaged_md))
        with pytest.raises(CheckpointCorruptError, match=f"{path / name}: {key!r} is recorded as {recorded} bytes"):
            engine.load(path, template=state)
    (path / ".metadata").write_bytes(pristine_md)
    shard = path / items[-1][0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    with pytest.raises(CheckpointCorruptError, match=f"{shard} is truncated: {items[-1][3]!r} needs bytes"):
        engine.load(path)
    assert bool(calls) == one_pass


@pytest.mark.parametrize("planned", [False, True], ids=["direct", "planned-by-dcp"])
def test_plan_cache_reuses_plans_but_not_when_a_dtype_or_key_changes(tmp_path: Path, planned: bool) -> None:
    """DCP's plan comparison ignores dtypes: a cached plan would record the old dtype. The same
    holds for the layout of a save that needs no plan (plain tensors only); a quantized tensor
    makes DCP plan the save."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlanner

    engine = DCPEngine()
    state = {"state_dict": {f"w{i}": torch.randn(8) for i in range(20)}}
    if planned:
        state["q"] = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    layouts = []
    for i in range(3):
        engine.save(state, tmp_path / f"c{i}")
        layouts.append(engine._layout)
    if planned:
        (key,) = engine._plan_keys
        assert key in SavePlanner._cached_save_plan  # the later saves used the cache
        assert layouts == [None] * 3
    else:
        assert not engine._plan_keys and layouts[0] is not None and layouts.count(layouts[0]) == 3
    state["state_dict"]["w0"] = state["state_dict"]["w0"].double()
    engine.save(state, tmp_path / "dtype")
    recorded = FileSystemReader(tmp_path / "dtype").read_metadata().state_dict_metadata["state_dict.w0"]
    assert recorded.properties.dtype == torch.float64
    assert engine.load(tmp_path / "dtype")["state_dict"]["w0"].dtype == torch.float64
    state["state_dict"]["new"] = torch.ones(2)
    engine.save(state, tmp_path / "key")
    assert torch.equal(engine.load(tmp_path / "key")["state_dict"]["new"], torch.ones(2))
    if not planned:
        assert engine._layout is not layouts[0]
    engine.close()
    if planned:
        assert key not in SavePlanner._cached_save_plan  # dropped with the engine
    assert engine._layout is None


def test_host_fingerprints_of_small_tensors_by_one_call_are_those_of_each_tensors_bytes(monkeypatch) -> None:
    """write/replicas.py: tensors of one piece are hashed by one call of the extension; their
    digests are what hashing each tensor's bytes gives (the per-piece path), a one-bit change
    included, and every other tensor (empty, not contiguous, a lazy conjugate, several pieces)
    keeps the per-piece path."""
    from areal_lightning.write import replicas

    if not replicas._ONE_CALL:
        pytest.skip("the compiled extension is not built here")
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, dtype=torch.complex64, generator=gen)
    tensors = [torch.randn(64, 64, generator=gen) for _ in range(50)] + [
        torch.ones(3, dtype=torch.bfloat16), torch.tensor(2.0), torch.arange(7, dtype=torch.int8),
        torch.zeros(0), torch.randn(5, 3, generator=gen).t(), z.conj(), torch.randn(3 << 20, generator=gen)]
    flipped = tensors[7].clone()
    flipped.view(-1).view(torch.int32)[100] ^= 1
    calls: list[int] = []
    real = replicas.KERNEL

    class Counted:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def copy(self, *args: Any) -> None:
            calls.append(len(args[2]))
            real.copy(*args)

    monkeypatch.setattr(replicas, "KERNEL", Counted())
    monkeypatch.setattr(replicas, "_PIECE", 4 << 20)  # the last tensor: 3 pieces
    fast = replicas._host_digests([*tensors, flipped])
    assert calls == [len(tensors) - 4 + 1]  # all but the empty, the transposed, the conjugate and the big one
    monkeypatch.setattr(replicas, "_ONE_CALL", False)
    assert replicas._host_digests([*tensors, flipped]) == fast
    assert fast[7] != fast[-1] and len(fast[-2]) == 3 and fast[3 + 50] == (0,)


def test_replicated_tensors_that_differ_are_found_by_fingerprint_and_mapped_back_per_rank(caplog, monkeypatch) -> None:
    """write/replicas.py: which tensors differ across ranks (host CRC32C, and the device digest
    computed here on CPU tensors), where they are stored, and which copy each rank reads."""
    from areal_lightning.write import replicas

    a = {"w": torch.arange(6.0), "bn.mean": torch.zeros(3), "half": torch.ones(2, dtype=torch.bfloat16),
         "t": torch.arange(4.0).reshape(2, 2).t()}  # a non-contiguous one too
    b = {k: v.clone() for k, v in a.items()}
    b["bn.mean"][1] = 1e-30  # one tiny difference
    gathered = [replicas.fingerprints(a), replicas.fingerprints(b)]
    assert replicas.differing(gathered) == ["bn.mean"]
    assert replicas._device_fingerprints([a["bn.mean"]]) != replicas._device_fingerprints([b["bn.mean"]])
    assert replicas._device_fingerprints([a["w"]]) == replicas._device_fingerprints([b["w"].clone()])
    monkeypatch.setattr(replicas, "_CHUNK", 8)  # the device digest a chunk at a time: a change past the first
    long, changed = torch.arange(37.0), torch.arange(37.0)
    changed[30] += 1
    digests = replicas._device_fingerprints([long, changed, long.clone(), torch.zeros(0)])
    assert digests[0] == digests[2] != digests[1]
    monkeypatch.setattr(replicas, "_PIECE", 8)  # host tensors in pieces hashed by threads: a change past the first
    monkeypatch.setattr(replicas, "_THREADS", 2)
    pieces = replicas.fingerprints({"long": long, "changed": changed, "same": long.clone(), "empty": torch.zeros(0)})
    assert pieces["long"] == pieces["same"] != pieces["changed"] and len(pieces["long"][2]) == 37 * 4 // 8 + 1
    assert replicas.differing([replicas.fingerprints(a), replicas.fingerprints(b)]) == ["bn.mean"]
    z = torch.randn(5, dtype=torch.complex64)  # lazily conjugated / negated views: their values fingerprinted
    lazy, held = {"c": z.conj(), "n": z.conj().imag}, {"c": z.conj().resolve_conj(), "n": z.conj().imag.resolve_neg()}
    assert replicas.differing([replicas.fingerprints(lazy), replicas.fingerprints(held)]) == []
    assert replicas.differing([replicas.fingerprints(lazy), replicas.fingerprints({"c": z, "n": z.imag})]) == ["c", "n"]
    assert replicas._device_fingerprints(list(lazy.values())) == replicas._device_fingerprints(list(held.values()))
    flat0, flat1 = dict(a), dict(b)
    replicas.store_per_rank(flat0, ["bn.mean"], rank=0, world_size=2)
    replicas.store_per_rank(flat1, ["bn.mean"], rank=1, world_size=2)
    assert "bn.mean" in flat0 and "bn.mean" not in flat1 and "areal_per_rank/2/1/bn.mean" in flat1
    keys = set(flat0) | set(flat1)
    assert replicas.restore_per_rank(keys, rank=1, world_size=2) == ({"areal_per_rank/2/1/bn.mean": "bn.mean"}, [])
    assert replicas.restore_per_rank(keys, rank=0, world_size=2) == ({}, [])  # rank 0: the usual key
    # one process (a 1-rank resume, or convert): rank 0's copy, named in the warning
    assert replicas.restore_per_rank(keys, rank=0, world_size=1) == ({}, ["bn.mean"])
    assert replicas.restore_per_rank(keys, rank=2, world_size=4) == ({}, ["bn.mean"])  # another world size
    with caplog.at_level("WARNING"):
        replicas.warn_world_change(["bn.mean"])
    assert "bn.mean" in caplog.text and "rank 0's copy" in caplog.text


def test_a_whole_load_reads_a_lone_local_file_in_parts_of_about_equal_bytes(tmp_path) -> None:
    """dcp_reader.split_by_bytes: a file's items in offset order, cut into runs of about equal bytes
    (each read by its own thread: a memory-tier slot is one file); every item exactly once. A
    one-file checkpoint then loads bit for bit through those parts."""
    from types import SimpleNamespace

    from areal_lightning.write import dcp_reader

    sizes = [5, 100, 3, 40, 40, 0, 7, 60, 1]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    entries = [(SimpleNamespace(offset=o, length=n), i) for i, (o, n) in enumerate(zip(offsets, sizes))][::-1]
    for k in (1, 2, 3, 4, 20):
        parts = dcp_reader.split_by_bytes(entries, k)
        order = [i for part in parts for _, i in part]
        assert sorted(order) == list(range(len(sizes)))  # every item, once
        assert [offsets[i] for i in order] == sorted(offsets)  # in offset order (an empty item ties its successor)
        assert 1 <= len(parts) <= k and all(parts)
        if k == 2:
            assert [sum(info.length for info, _ in part) for part in parts] == [148, 108]
    gen = torch.Generator().manual_seed(0)
    state = {"state_dict": {f"w{i}": torch.randn(1000 + 37 * i, generator=gen) for i in range(30)}, "step": 1}
    engine = DCPEngine(thread_count=1)
    engine.save(state, tmp_path / "c")
    assert len(list((tmp_path / "c").glob("*.distcp"))) == 1
    read = []
    real = dcp_reader.AdoptingReader._gather

    def spy(self, jobs, read_file):
        read.append([name for name, _ in (jobs.items() if isinstance(jobs, dict) else jobs)])
        return real(self, jobs, read_file)

    dcp_reader.AdoptingReader._gather = spy
    try:
        template = {"state_dict": {k: torch.empty_like(v) for k, v in state["state_dict"].items()}}
        loaded = engine.load(tmp_path / "c", template=template)
    finally:
        dcp_reader.AdoptingReader._gather = real
        engine.close()
    assert read == [["__0_0.distcp"] * dcp_reader.READ_THREADS]  # the one file, read in parts at once
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in state["state_dict"].items())


def test_a_large_mapped_file_is_verified_in_parts_and_a_flipped_byte_in_any_part_is_named(tmp_path,
                                                                                         monkeypatch) -> None:
    """manifest.verify_mapped (the memory tier's check of a slot before a resume) checks a file
    of 16 MB or more by threads, a part each: a byte flipped in the last part's item is found
    and named, as in the first part's."""
    from concurrent import futures

    from areal_lightning.commit import manifest

    gen = torch.Generator().manual_seed(1)
    state = {"state_dict": {f"w{i}": torch.randn(300_000, generator=gen) for i in range(16)}}  # 19 MB, one file
    engine = DCPEngine(thread_count=1)
    engine.save(state, tmp_path / "c")
    engine.close()
    [data] = list((tmp_path / "c").glob("*.distcp"))
    pools = []
    real = futures.ThreadPoolExecutor

    class Counted(real):
        def __init__(self, workers, *a, **k):
            pools.append(workers)
            super().__init__(workers, *a, **k)

    monkeypatch.setattr(futures, "ThreadPoolExecutor", Counted)
    tensors = 16 * 300_000 * 4
    assert manifest.verify_mapped(tmp_path / "c", "damaged") == data.stat().st_size > tensors  # + the skeleton
    assert pools and pools[-1] > 1  # in parts
    raw = bytearray(data.read_bytes())
    for at in (100, tensors - 100):  # in the first item, in the last one (the skeleton follows)
        flipped = bytearray(raw)
        flipped[at] ^= 0x10
        data.write_bytes(flipped)
        with pytest.raises(CheckpointCorruptError, match=r"w\d+.*damaged"):
            manifest.verify_mapped(tmp_path / "c", "damaged")
    data.write_bytes(raw)
    assert manifest.verify_mapped(tmp_path / "c", "damaged") == len(raw)


def test_no_garbage_collection_runs_while_a_metadata_of_many_items_is_unpickled(tmp_path: Path) -> None:
    """The ``.metadata`` of 2,000 items unpickles into about 20,000 objects; in a process with
    Lightning and transformers imported, the collections their allocations start included a full
    one at every fresh-process load (0.24 s of a 0.33 s load, measured). The collector is paused
    for the unpickle (here made to run at every 10 allocations), then resumed as it was."""
    import gc

    from areal_lightning.write.dcp_reader import reader_of

    engine = DCPEngine()
    engine.save({"state_dict": {f"layer{i}.weight": torch.zeros(2) for i in range(2000)}}, tmp_path / "ckpt")
    engine.close()
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    threshold, running = gc.get_threshold(), gc.isenabled()
    gc.callbacks.append(count)
    try:
        reader = reader_of(tmp_path / "ckpt")
        gc.enable()
        gc.set_threshold(10)
        runs.clear()
        metadata = reader.read_metadata()
        during = len(runs)  # not paused: about 2,000 (one per 10 of its 20,000 allocations)
        assert len(metadata.state_dict_metadata) == 2001 and during <= 2 and gc.isenabled()
        [[] for _ in range(100)]
        assert len(runs) > during  # the collector runs again
        gc.disable()
        reader_of(tmp_path / "ckpt").read_metadata()
        assert not gc.isenabled()  # a collector the caller paused stays paused
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        (gc.enable if running else gc.disable)()
