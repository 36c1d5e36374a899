"""Benchmark HF export: our sync and async export against ``model.save_pretrained``.

Usage::

    python benchmarks/hf_export.py --json benchmarks/results/hf_export.json [--repeats 3] [--layers 8]

The model is a randomly initialised Llama (hidden 768, vocab 32000, ``--layers`` decoder
layers; about 106M parameters, 425 MB in fp32, at 8 layers), built from a config.

Rows (medians over interleaved repeats):
  host_copy        one copy of the state dict into warm, reused host buffers (staging limit)
  save_pretrained  ``model.save_pretrained(dir)``: blocked = the call; durable = the call +
                   fsync of every file (transformers itself does not fsync)
  ours_sync        ``export_hf`` (save_pretrained into a temp folder, tokenizer, fsync, rename)
  ours_async       HFSaverCallback's async path: host staging (blocked), then the same
                   write in a background thread (durable when it is published)

``blocked_s`` is how long the training loop is held; ``durable_s`` until the export is
fsynced and (for ours) renamed into place. Ratios are against ``save_pretrained``'s call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_lightning.commit.atomic import fsync_tree  # noqa: E402
from areal_lightning.stage import BackgroundWorker  # noqa: E402
from areal_lightning.commit.atomic import AtomicDir  # noqa: E402
from areal_lightning.hf_export import export_hf  # noqa: E402

METHODS = ("host_copy", "save_pretrained", "ours_sync", "ours_async")


def build_model(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir beside the JSON)")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    from areal_lightning.tools.demo import build_tokenizer

    hf_logging.disable_progress_bar()

    model, tokenizer = build_model(args.layers), build_tokenizer()
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    scratch = Path(tempfile.mkdtemp(prefix="hf_bench_", dir=args.dir or Path(args.json).resolve().parent))
    worker = BackgroundWorker("bench-hf")
    times: dict[str, list[tuple[float, float | None]]] = {m: [] for m in METHODS}

    def fresh(name: str) -> Path:
        path = scratch / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def host_copy() -> tuple[float, float | None]:
        t0 = time.perf_counter()
        worker.stage_to_host(model.state_dict())
        return time.perf_counter() - t0, None

    def save_pretrained() -> tuple[float, float | None]:
        out = fresh("hf_plain")
        t0 = time.perf_counter()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        t1 = time.perf_counter()
        fsync_tree(out)
        return t1 - t0, time.perf_counter() - t0

    def ours_sync() -> tuple[float, float | None]:
        out = fresh("ours_sync")
        t0 = time.perf_counter()
        export_hf(model, out, tokenizer)
        t = time.perf_counter() - t0
        return t, t

    def ours_async() -> tuple[float, float | None]:
        out = fresh("ours_async")
        t0 = time.perf_counter()
        staged = worker.stage_to_host(model.state_dict())
        tmp = AtomicDir(out).create()
        worker.submit(lambda: export_hf(model, out, tokenizer, state_dict=staged, tmp_dir=tmp), label=str(out))
        blocked = time.perf_counter() - t0
        worker.wait()
        return blocked, time.perf_counter() - t0

    runners: dict[str, Callable[[], tuple[float, float | None]]] = {
        "host_copy": host_copy, "save_pretrained": save_pretrained, "ours_sync": ours_sync, "ours_async": ours_async}
    try:
        host_copy()  # warm the staging buffers, as a long run would have them
        for _ in range(args.repeats):
            for method in METHODS:
                times[method].append(runners[method]())
    finally:
        worker.close()
        shutil.rmtree(scratch, ignore_errors=True)

    base = statistics.median(b for b, _ in times["save_pretrained"])
    results = []
    print(f"\nHF export of a {n_params / 1e6:.0f}M-parameter Llama ({nbytes / 1e6:.0f} MB fp32), "
          f"median of {args.repeats}")
    print(f"{'method':<16} {'blocked_s':>10} {'durable_s':>10} {'GB/s':>7} {'blocked/save_pretrained':>24}")
    for method in METHODS:
        blocked = statistics.median(b for b, _ in times[method])
        durables = [d for _, d in times[method] if d is not None]
        durable = statistics.median(durables) if durables else None
        gbps = nbytes / (durable or blocked) / 1e9
        results.append({"method": method, "blocked_s": blocked, "durable_s": durable, "gbps": gbps,
                        "blocked_vs_save_pretrained": blocked / base})
        print(f"{method:<16} {blocked:>10.3f} {durable if durable is not None else float('nan'):>10.3f} "
              f"{gbps:>7.2f} {blocked / base:>24.3f}")
    report = {
        "results": results,
        "model": {"params": n_params, "bytes": nbytes, "layers": args.layers},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "repeats": args.repeats,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
