"""The ``areal-lightning`` command line.

- ``areal-lightning demo [--config FILE] [key=value ...]``: the demo training job.
- ``areal-lightning run [--retries N] [--config FILE] -- <command ...>``: re-run a failing command.
- ``areal-lightning inspect PATH [--verify] [--json] [--user U --experiment E --trial T]``: a
  read-only report of the exports and the recover checkpoint of trials (exit 0 valid, 1 invalid,
  2 usage error).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from areal_lightning.config import ConfigError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from areal_lightning.demo import run_demo

    summary = run_demo(args.config, args.overrides)
    print(f"\ntrained {summary['global_step']} steps")
    if summary.get("trial_dir"):
        print(f"trial folder: {summary['trial_dir']}")
        print("HF exports (load with AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained):")
        for path in summary["exports"]:
            print(f"  {path}")
    for (prompt, text), want in zip(summary["generations"], summary.get("expected", [])):
        print(f"  generate({prompt!r}) -> {text!r}   (correct: {prompt}{want})")
    return 0


def _run(args: argparse.Namespace) -> int:
    from areal_lightning.config import load_config
    from areal_lightning.supervisor import run_with_retries

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


def _inspect(args: argparse.Namespace) -> int:
    from areal_lightning.inspect import run_inspect

    return run_inspect(args.path, verify=args.verify, as_json=args.json, user=args.user,
                       experiment=args.experiment, trial=args.trial)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="areal-lightning", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny Llama on addition and export HF checkpoints")
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
    insp.set_defaults(func=_inspect)
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


if __name__ == "__main__":
    sys.exit(main())
