"""The README table of ``benchmarks/run.py``: the header (machine, versions, mode), every measured section's
rows (each section's module writes its own) and the closing note, rebuilt from the JSON files in the results folder."""

from __future__ import annotations

import json
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

SECTION_NAMES = (
    "overhead_one_device",
    "ddp_vs_flair_native",
    "find_unused_parameters",
    "sharded_evaluation",
    "ddp_vs_fsdp",
    "checkpoint_cost",
    "resume_latency",
    "end_to_end_fine_tune",
    "ddp_communication",
)
"""The results files (``<out-dir>/<name>.json``), in the order of the README table."""


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The README table, from the results as written to the JSON files."""
    first = next(iter(results.values()))
    machine, mode = first["machine"], first["mode"]
    lines = [
        "# flair-fabric benchmarks",
        "",
        f"`benchmarks/run.py{' --quick' if mode == 'quick' else ''}`, finished {first['finished_utc']},"
        f" {first['bench_wall_seconds'] / 60:.1f} min. Machine: {machine['cpu_count']} CPUs ({machine['processor']}),"
        f" no GPU; torch {machine['torch']}, flair {machine['flair']}, lightning {machine['lightning']},"
        f" transformers {machine['transformers']}, Python {machine['python']};"
        f" {first['torch_threads_per_process']} torch thread(s) per process (OMP_NUM_THREADS);"
        f" load average (1/5/15 min) {machine['load_average_1_5_15']} at start,"
        f" {first['load_average_1_5_15_at_end']} at end.",
        "",
        *(
            ["**Quick mode: a smoke run with one or two repetitions of tiny workloads; the numbers mean little.**", ""]
            if mode == "quick"
            else []
        ),
        "Sections 1-3: only the training part of each epoch is timed (one TrainerPlugin, before_training_epoch to"
        " after_training_epoch, in both trainers); no dev/test evaluation, no model files; same seeded model and"
        " same batches (shuffle=False) for both sides. Raw timings and the exact method: the JSON files next to this"
        " one.",
        "",
    ]
    lines += overhead_one_device.markdown_lines(results)
    lines += ddp_vs_flair_native.markdown_lines(results)
    lines += find_unused_parameters.markdown_lines(results)
    lines += sharded_evaluation.markdown_lines(results)
    lines += ddp_vs_fsdp.markdown_lines(results)
    lines += preemption.markdown_lines(results)
    lines += end_to_end.markdown_lines(results)
    lines += ddp_communication.markdown_lines(results)
    lines += [
        "Timings on a shared or busy machine are noisy: rerun `make bench` on a quiet one before quoting them.",
        "",
    ]
    return "\n".join(lines)


def write_readme(out_dir: Path) -> None:
    """README.md from every section's JSON file in ``out_dir`` (so ``--only`` keeps the other sections)."""
    found = [out_dir / f"{name}.json" for name in SECTION_NAMES if (out_dir / f"{name}.json").exists()]
    if not found:
        raise SystemExit(f"no results in {out_dir}: run the benchmarks first")
    saved = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in found}
    (out_dir / "README.md").write_text(markdown(saved), encoding="utf-8")
    print(f"wrote {out_dir / 'README.md'}")
