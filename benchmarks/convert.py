"""The memory and time of ``convert``: a recover checkpoint to an HF folder and to one Lightning file.

    python benchmarks/convert.py --json benchmarks/results/convert.json [--hidden 1024 --layers 2 --vocab 8000]

Builds a trial: one training step of a Llama (fp32, AdamW) under ``RecoverCallback`` (its
checkpoint holds weights + two Adam moments), then runs each conversion in a fresh process that
samples its own anonymous memory (``RssAnon``, every 2 ms) and reports its peak RSS (``VmHWM``,
which counts the memory-mapped scratch pages too: page cache, written back under pressure), both
above the same process's memory just before the conversion (torch, transformers imported). Peers
in the same run: the whole checkpoint loaded into memory then ``save_pretrained`` (what a convert
without streaming does), and ``torch.save`` of the loaded checkpoint dict. Ratios are against the
largest tensor and against the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

METHODS = ("convert_hf", "convert_lightning", "load_all_save_pretrained", "load_all_torch_save")


def _status(field: str) -> float:
    """A ``/proc/self/status`` field in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def build_trial(root: Path, hidden: int, layers: int, vocab: int) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_lightning import RecoverCallback

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                max_position_embeddings=64))

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = LM()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    recover = RecoverCallback(fileroot=str(root), experiment_name="bench", trial_name="t", user="u", freq_steps=1,
                              io_mode="sync")
    pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[recover]).fit(
        module, DataLoader(TensorDataset(ids), batch_size=2))
    sizes = [p.numel() * p.element_size() for p in module.parameters()]
    ckpt = root / "checkpoints/u/bench/t/default/recover_checkpoint"
    return {"weights_mb": sum(sizes) / 1e6, "largest_tensor_mb": max(sizes) / 1e6,
            "checkpoint_mb": sum(f.stat().st_size for f in ckpt.iterdir()) / 1e6, "tensors": len(sizes)}


def child(method: str, trial: Path, out: Path) -> None:
    """One conversion in this process; prints its measurements as one JSON line."""
    import torch  # noqa: F401 - imported before the baseline, as every method needs them
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import areal_lightning.tools.inspect  # noqa: F401
    from areal_lightning import convert
    from areal_lightning.write.dcp import DCPEngine

    base_anon, peak = _status("RssAnon"), [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    base_hwm = _status("VmRSS")
    thread.start()
    start = time.perf_counter()
    if method == "convert_hf":
        convert(trial, "hf", out)
    elif method == "convert_lightning":
        convert(trial, "lightning", out)
    else:
        import torch
        from transformers import AutoConfig, LlamaForCausalLM

        ckpt = DCPEngine().load(trial / "default" / "recover_checkpoint")
        if method == "load_all_torch_save":
            torch.save(ckpt, out)
        else:
            info = json.loads((trial / "recover_info" / "checkpoint_info.json").read_text())["hf_models"]["default"]
            with torch.device("meta"):
                model = LlamaForCausalLM(AutoConfig.from_pretrained(trial / info["files"]))
            state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
            model.save_pretrained(out, state_dict=state)
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    print(json.dumps({"wall_s": wall, "peak_anon_mb": peak[0] - base_anon, "peak_rss_mb": _status("VmHWM") - base_hwm,
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--root", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results JSON")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "TRIAL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    root = args.root or Path(tempfile.mkdtemp(prefix="convert-bench-"))
    try:
        sizes = build_trial(root / "run", args.hidden, args.layers, args.vocab)
        trial = root / "run/checkpoints/u/bench/t"
        rows = []
        for method in METHODS:
            out = root / f"out-{method}" if "hf" in method or "pretrained" in method else root / f"{method}.ckpt"
            proc = subprocess.run([sys.executable, __file__, "--child", method, str(trial), str(out)],
                                  capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")
            row = {"method": method, **json.loads(proc.stdout.strip().splitlines()[-1])}
            row["anon_over_largest_tensor"] = row["peak_anon_mb"] / sizes["largest_tensor_mb"]
            row["anon_over_checkpoint"] = row["peak_anon_mb"] / sizes["checkpoint_mb"]
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint {sizes['checkpoint_mb']:.0f} MB (weights {sizes['weights_mb']:.0f} MB + AdamW moments), "
          f"{sizes['tensors']} parameters, largest tensor {sizes['largest_tensor_mb']:.1f} MB")
    print(f"{'method':<26}{'wall s':>8}{'peak anon MB':>14}{'/ largest':>11}{'/ ckpt':>8}{'peak RSS MB':>13}")
    for r in rows:
        print(f"{r['method']:<26}{r['wall_s']:>8.2f}{r['peak_anon_mb']:>14.1f}{r['anon_over_largest_tensor']:>11.2f}"
              f"{r['anon_over_checkpoint']:>8.2f}{r['peak_rss_mb']:>13.1f}")
    print("peak anon: the process's own memory above its level before the conversion; peak RSS adds the "
          "memory-mapped scratch pages (page cache)")
    write_json(args.json, {"results": rows, "sizes": sizes,
                           "config": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}})


if __name__ == "__main__":
    main()
