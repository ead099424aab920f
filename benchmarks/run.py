"""flair-fabric benchmarks: ``make bench`` (about 11 minutes on 2 CPU cores) or ``--quick`` (about 3 minutes).

1. overhead_one_device: FabricTrainer(devices=1) vs flair's ModelTrainer, training time per epoch.
2. ddp_vs_flair_native: FabricTrainer(devices=2) vs flair's own multi_gpu=True on 2 CPU processes, samples/s.
3. find_unused_parameters: FabricTrainer(devices=2) with DDP's unused-parameter search forced on vs off.
4. sharded_evaluation: evaluating a dev split with flair_fabric.evaluate on 2 processes vs flair's evaluate in one.
5. ddp_vs_fsdp: memory and time of strategy="fsdp" vs "ddp".
6. checkpoint_cost, 7. resume_latency: preemption-proof training (``preemption.py``).
8. end_to_end_fine_tune: a whole fine_tune (dev every epoch, final test) vs flair's multi_gpu=True (``end_to_end.py``).
9. ddp_communication: where a 2-rank step's time goes; exact defaults, compression (``ddp_communication.py``).

Sections 1-5 are measured and tabled by the modules of their names (``overhead_one_device.py``, ...). Every
measurement runs in fresh worker processes (``worker.py``, started by ``worker_runner.py``) with the sizes of
``plans.py``; results go to ``<out-dir>/<name>.json`` and a table to ``<out-dir>/README.md`` (``report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ddp_communication
import ddp_vs_flair_native
import ddp_vs_fsdp
import end_to_end
import find_unused_parameters
import overhead_one_device
import preemption
import sharded_evaluation
from plans import PLANS
from report import write_readme
from section_statistics import r
from worker_runner import Runner

HERE = Path(__file__).resolve().parent

SECTIONS = (
    "overhead",
    "ddp",
    "find_unused",
    "evaluation",
    "sharding",
    "checkpointing",
    "resume",
    "end_to_end",
    "communication",
)


def machine_info() -> dict[str, Any]:
    """Machine and versions, read in a child process so that this one never imports torch."""
    code = "import json, common; print(json.dumps(common.machine()))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition: a smoke run (~2 min)")
    parser.add_argument(
        "--out-dir", type=Path, help="default: benchmarks/results (benchmarks/results/quick with --quick)"
    )
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="run only these sections (README.md is rebuilt from all JSON files in the folder)",
    )
    parser.add_argument("--devices", type=int, default=2, help="processes for sections 2 and 3 (default: 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads per process (default: CPUs / 2)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker process (default: 900)")
    parser.add_argument("--verbose", action="store_true", help="print every timed run")
    parser.add_argument("--readme-only", action="store_true", help="rewrite README.md from the JSON files, run nothing")
    args = parser.parse_args()

    mode = "quick" if args.quick else "full"
    plan = PLANS[mode]
    out_dir = args.out_dir or (HERE / "results" / "quick" if args.quick else HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.readme_only:
        write_readme(out_dir)
        return
    sections = args.only or list(SECTIONS)
    started = time.perf_counter()
    machine = machine_info()
    print(
        f"flair-fabric benchmarks ({mode}): {machine['cpu_count']} CPUs, torch {machine['torch']}, flair"
        f" {machine['flair']}, lightning {machine['lightning']}; {args.threads} thread(s) per process",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flair-fabric-bench-") as work_dir:
        runner = Runner(args.threads, args.timeout, Path(work_dir), args.verbose)
        if "overhead" in sections:
            results["overhead_one_device"] = overhead_one_device.overhead_section(runner, plan["overhead"])
        if "ddp" in sections:
            results["ddp_vs_flair_native"] = ddp_vs_flair_native.ddp_section(runner, plan["ddp"], args.devices)
        if "find_unused" in sections:
            job, launches = plan["find_unused"]
            results["find_unused_parameters"] = find_unused_parameters.find_unused_section(
                runner, job, launches, args.devices
            )
        if "evaluation" in sections:
            job, launches = plan["evaluation"]
            results["sharded_evaluation"] = sharded_evaluation.evaluation_section(runner, job, launches, args.devices)
        if "sharding" in sections:
            job, launches = plan["sharding"]
            results["ddp_vs_fsdp"] = ddp_vs_fsdp.sharding_section(runner, job, launches, args.devices)
        if "checkpointing" in sections:
            job, every = plan["checkpointing"]
            results["checkpoint_cost"] = preemption.checkpoint_cost_section(runner, job, args.devices, every)
        if "resume" in sections:
            job, every, launches = plan["resume"]
            results["resume_latency"] = preemption.resume_latency_section(runner, job, args.devices, every, launches)
        if "end_to_end" in sections:
            job, launches, dev_size = plan["end_to_end"]
            results["end_to_end_fine_tune"] = end_to_end.end_to_end_section(
                runner, job, args.devices, launches, dev_size
            )
        if "communication" in sections:
            results["ddp_communication"] = ddp_communication.communication_section(
                runner, plan["communication"], args.devices
            )
    wall = time.perf_counter() - started
    common = {
        "mode": mode,
        "machine": machine,
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "torch_threads_per_process": args.threads,
        "bench_wall_seconds": r(wall, 1),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results = {name: {"name": name, **common, **section} for name, section in results.items()}
    for name, result in results.items():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    write_readme(out_dir)
    print(f"benchmarks done in {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
