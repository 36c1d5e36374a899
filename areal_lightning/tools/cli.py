"""The ``areal-lightning`` command line.

- ``areal-lightning demo [--config FILE] [key=value ...]``: the demo training job.
- ``areal-lightning run [--retries N] [--config FILE] -- <command ...>``: re-run a failing command.
- ``areal-lightning inspect PATH [--verify] [--json] [--user U --experiment E --trial T]``: a
  read-only report of the exports and the recover checkpoint of trials (exit 0 valid, 1 invalid,
  2 usage error).
- ``areal-lightning download URI [DEST]``: fetch a committed HF export from an object store.
- ``areal-lightning certify [--points all|P1,P2] [--modes sync,async] [--json FILE] [--timeout S]
  -- <training command with {root} {mode}>``: SIGKILL the command at every fault point, rerun it,
  check the exact resume (exit 0 all passed, 1 a case failed, 2 usage error).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from areal_lightning.config import ConfigError
from areal_lightning.errors import AreaLightningError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from areal_lightning.tools.demo import run_demo

    summary = run_demo(args.config, args.overrides)
    print(f"\ntrained {summary['global_step']} steps")
    if summary.get("trial_dir"):
        print(f"trial folder: {summary['trial_dir']}")
        print("HF exports (load with AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained):")
        for path in summary["exports"]:
            print(f"  {path}")
    for (prompt, text), want in zip(summary["generations"], summary.get("expected", [])):
        print(f"  generate({prompt!r}) -> {text!r}   (correct: {prompt}{want})")
    return 0 if summary.get("losses_match") is not False else 1


def _run(args: argparse.Namespace) -> int:
    from areal_lightning.config import load_config
    from areal_lightning.tools.supervisor import run_with_retries

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("areal-lightning run: no command given; usage: areal-lightning run [--retries N] -- <command ...>",
              file=sys.stderr)
        return 2
    retries = args.retries
    if retries is None:
        retries = load_config(args.config, strict=False).recover.retries if args.config else 3
    if retries < 0:
        raise ConfigError("--retries", f"expected an integer >= 0, got {retries}")
    return run_with_retries(command, retries)


def _download(args: argparse.Namespace) -> int:
    from areal_lightning.tools.download import download_export

    try:
        path = download_export(args.uri, args.dest)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"areal-lightning download: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from areal_lightning.tools.convert import convert

    out = convert(args.path, args.to, args.out, name=args.name, model_attr=args.model_attr,
                  hf_config=args.hf_config, weights_only=not args.trusted)
    print(out)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from areal_lightning.tools.inspect import run_inspect

    return run_inspect(args.path, verify=args.verify, as_json=args.json, user=args.user,
                       experiment=args.experiment, trial=args.trial, memory_root=args.memory_root)


def _certify(args: argparse.Namespace) -> int:
    from areal_lightning.tools.certify import CertifyUsageError, certify

    try:
        return certify(args.command, points=args.points or "all", modes=args.modes, timeout=args.timeout,
                       jobs=args.jobs, nth=args.nth, workdir=args.workdir, keep=args.keep, json_path=args.json,
                       strict=args.strict, chain=args.chain)
    except CertifyUsageError as exc:
        print(f"areal-lightning certify: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="areal-lightning", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Llama on addition, SIGKILL it mid-run, resume it bit for bit, export HF checkpoints")
    demo.add_argument("--config", default=None, help="YAML config (default: built-in demo defaults)")
    demo.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.max_epochs=1 saver.freq_steps=20")
    demo.set_defaults(func=_demo)
    run = sub.add_parser("run", help="run a training command, re-running it (resuming) when it fails")
    run.add_argument("--retries", type=int, default=None,
                     help="how many times to re-run a failed command (default: recover.retries of --config, else 3)")
    run.add_argument("--config", default=None, help="experiment YAML whose recover.retries is the default")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    run.set_defaults(func=_run)
    insp = sub.add_parser(
        "inspect", help="report the HF exports and recover checkpoint of trials (read-only)",
        description="Report every HF export (complete?), the recover checkpoint and recover_info/ of each trial "
                    "below PATH. Exit code 0: all valid; 1: something is invalid or corrupt; 2: usage error.")
    insp.add_argument("path", help="a fileroot (holding checkpoints/) or a trial folder "
                                   "{fileroot}/checkpoints/{user}/{experiment}/{trial}")
    insp.add_argument("--verify", action="store_true",
                      help="check size and CRC32 of every recover checkpoint file (reads the whole checkpoint)")
    insp.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    insp.add_argument("--user", default=None, help="only trials of this user")
    insp.add_argument("--experiment", default=None, help="only trials of this experiment")
    insp.add_argument("--trial", default=None, help="only trials with this name")
    insp.add_argument("--memory-root", default=None,
                      help="the memory tier's root on this node (default /dev/shm/areal-lightning)")
    insp.set_defaults(func=_inspect)
    conv = sub.add_parser(
        "convert", help="write a recover checkpoint as an HF folder, one Lightning checkpoint file or a stock DCP folder",
        description="Write the recover checkpoint at PATH as the HF folder HFSaverCallback would have exported at "
                    "its step (--to hf), or as one Lightning checkpoint file for load_from_checkpoint and "
                    "trainer.fit(ckpt_path=...) (--to lightning), or as a DCP folder a stock "
                    "torch.distributed.checkpoint.load reads (--to dcp). One CPU process, any strategy and world size "
                    "that wrote it; every item is verified as it is read. Exit code 0: written (its path is "
                    "printed); 1: the checkpoint is damaged or cannot be converted; 2: usage error.")
    conv.add_argument("path", help="a fileroot holding one trial, a trial folder "
                                   "{fileroot}/checkpoints/{user}/{experiment}/{trial}, or a recover_checkpoint/ folder")
    conv.add_argument("--to", required=True, choices=["hf", "lightning", "dcp"], help="what to write")
    conv.add_argument("--out", required=True, help="the folder (hf, dcp) or .ckpt file (lightning) to create")
    conv.add_argument("--name", default="default", help="the model name (HFSaverCallback name=; default: default)")
    conv.add_argument("--model-attr", default=None,
                      help="the LightningModule attribute holding the HF model (default: as recorded, else 'model')")
    conv.add_argument("--hf-config", default=None, metavar="DIR",
                      help="a folder with config.json and tokenizer files, for a checkpoint that records no HF model")
    conv.add_argument("--trusted", action="store_true",
                      help="unpickle the non-tensor state without weights_only (trusted storage only)")
    conv.set_defaults(func=_convert)
    down = sub.add_parser(
        "download", help="download a committed HF export from an object store (for from_pretrained)",
        description="Download the committed HF export at URI (an export folder, or a model folder: its newest "
                    "export) into DEST and print DEST. Exit code 0: done; 2: nothing committed there or DEST not "
                    "empty.")
    down.add_argument("uri", help="s3://.../{trial}/{model}/epoch{E}epochstep{S}globalstep{G}, or "
                                   "s3://.../{trial}/{model} for its newest export")
    down.add_argument("dest", nargs="?", default=None, help="local folder (default: a new temporary one)")
    down.set_defaults(func=_download)
    cert = sub.add_parser(
        "certify", help="SIGKILL a training command at every checkpoint fault point and prove it resumes exactly",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "For each mode: run the command once uninterrupted (the reference); then for each fault point,\n"
            "run it with AREAL_LIGHTNING_FAULT=<point>:kill@N in a fresh {root}, kill its whole process group\n"
            "when the point fires, run it again, and check that it resumed from the last committed\n"
            "checkpoint, that every per-step loss equals the reference bit for bit, that no temporary\n"
            "folder is left and that every HF export loads (and equals the reference's).\n\n"
            "The command must use RecoverCallback with fileroot={root}, take the mode from {mode}, and\n"
            "record its losses: add areal_lightning.tools.certify.LossRecorder() to the Trainer's callbacks (or\n"
            "append {\"step\": int, \"loss\": float.hex(), \"rank\": int} JSON lines to the file {losses}).\n"
            "{root}, {mode}, {losses} are also in $AREAL_LIGHTNING_CERTIFY_ROOT/_MODE/_LOSSES.\n\n"
            "Exit code 0: no case failed; 1: a case or a reference run failed (--strict: or a point was\n"
            "not reached); 2: usage error."),
        epilog="example:\n  areal-lightning certify --modes sync,async --jobs 2 -- python train.py "
               "--fileroot {root} --io-mode {mode}")
    cert.add_argument("--points", action="append", default=None,
                      help="'all' (default) or comma-separated fault points, each optionally with @N "
                           "(kill at the N-th hit); MODE=... for one mode only (repeat the option)")
    cert.add_argument("--modes", default="sync,async",
                      help="comma-separated values substituted for {mode} (default: sync,async)")
    cert.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    cert.add_argument("--timeout", type=float, default=600, metavar="S", help="seconds per run (default 600)")
    cert.add_argument("--jobs", type=int, default=1, help="cases run in parallel (default 1)")
    cert.add_argument("--nth", type=int, default=None,
                      help="kill at the N-th hit of each point (default: the middle hit of the reference run)")
    cert.add_argument("--workdir", default=None, help="empty folder for the runs (default: a new temporary one)")
    cert.add_argument("--keep", action="store_true", help="keep the folders of passing cases too")
    cert.add_argument("--strict", action="store_true", help="exit 1 also when a point is never reached")
    cert.add_argument("--chain", action="store_true",
                      help="faster: each rerun is itself killed at the next point (one run per case instead of "
                           "two; --jobs chains per mode); the final checks run after the last, clean run")
    cert.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    cert.set_defaults(func=_certify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``areal-lightning`` console script; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"areal-lightning: config error: {exc}", file=sys.stderr)
        return 2
    except AreaLightningError as exc:  # e.g. the demo's resumed run differs from the reference
        print(f"areal-lightning: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
