"""What the per-rank check adds to a replicated (DDP) save: the fingerprints of every replicated tensor.

Usage::

    python benchmarks/replicated_fingerprints.py --mb 256 --json benchmarks/results/replicated_fingerprints.json \
        [--repeats 5] [--workdir /dev/shm] [--count 64]

Every collective save under a replicated strategy fingerprints each replicated tensor on every
rank (CRC32C of its bytes on the host; write/replicas.py) and sends the fingerprints with the
agreement the save makes anyway, to find the tensors that differ across ranks. This measures, on
one process and the same ``--mb`` MB of fp32 tensors in ``--count`` tensors (a model's weights and
two Adam moments):

  fingerprints   ``replicas.fingerprints`` of the state (what each rank adds to a save)
  dcp_sync       ``DCPEngine.save``, durable and committed when it returns (the save it is added to)
  torch_save     ``torch.save`` of the same dict + fsync (the peer)
  memcpy         a copy of every tensor (the scale: an async save stages at least this)

Medians over interleaved repeats, after one warm-up of each. The point is the ratio
``fingerprints / dcp_sync``: the share of a save the check costs (on ``/dev/shm`` the software's
own cost, on disk what a user sees). A table and JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_lightning.write import replicas  # noqa: E402
from areal_lightning.write.dcp import DCPEngine  # noqa: E402
from _report import write_json  # noqa: E402

METHODS = ("fingerprints", "dcp_sync", "torch_save", "memcpy")


def state(mb: int, count: int) -> dict[str, Any]:
    """``mb`` MB of fp32 in ``count`` tensors, nested as a Lightning checkpoint holds them."""
    per = mb * (1 << 20) // 4 // count
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(count)}
    return {"state_dict": tensors}


def torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None, help="where saves go (default: a temp folder on disk)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    obj = state(args.mb, args.count)
    flat = {f"state_dict.{k}": v for k, v in obj["state_dict"].items()}
    root = Path(tempfile.mkdtemp(prefix="fp-bench-", dir=args.workdir))
    engine = DCPEngine()
    sink: dict[str, torch.Tensor] = {k: torch.empty_like(v) for k, v in flat.items()}
    n = [0]

    def dcp_sync() -> None:
        n[0] += 1
        engine.save(obj, root / f"dcp{n[0]}")
        shutil.rmtree(root / f"dcp{n[0]}")

    def torch_peer() -> None:
        torch_save(obj, root / "peer.pt")
        (root / "peer.pt").unlink()

    def memcpy() -> None:
        for k, v in flat.items():
            sink[k].copy_(v)

    runs: dict[str, Callable[[], Any]] = {"fingerprints": lambda: replicas.fingerprints(flat), "dcp_sync": dcp_sync,
                                          "torch_save": torch_peer, "memcpy": memcpy}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    try:
        for method in METHODS:  # warm-up (the first save also plans)
            runs[method]()
        for _ in range(args.repeats):
            for method in METHODS:
                start = time.perf_counter()
                runs[method]()
                times[method].append(time.perf_counter() - start)
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)

    median = {m: statistics.median(t) for m, t in times.items()}
    gb = args.mb / 1024
    where = str(args.workdir or tempfile.gettempdir())
    print(f"{args.mb} MB in {args.count} fp32 tensors, saves in {where}, median of {args.repeats}")
    print(f"{'method':<14}{'seconds':>10}{'GB/s':>8}{'x dcp_sync':>12}")
    for m in METHODS:
        print(f"{m:<14}{median[m]:>10.4f}{gb / median[m]:>8.2f}{median[m] / median['dcp_sync']:>12.3f}")
    doc = {"mb": args.mb, "count": args.count, "repeats": args.repeats, "workdir": where,
           "median_s": median, "all_s": times,
           "ratios": {"fingerprints_over_dcp_sync": median["fingerprints"] / median["dcp_sync"],
                      "fingerprints_over_torch_save": median["fingerprints"] / median["torch_save"],
                      "fingerprints_over_memcpy": median["fingerprints"] / median["memcpy"]}}
    print("fingerprints / dcp_sync = {fingerprints_over_dcp_sync:.3f}, / torch_save = "
          "{fingerprints_over_torch_save:.3f}, / memcpy = {fingerprints_over_memcpy:.3f}".format(**doc["ratios"]))
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
