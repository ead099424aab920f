"""The report: ``gpu_check.json`` (every check's row with its numbers, the run's settings and criteria) and
``README.md`` (the tables). The review of CUDA-only code paths is docs/gpu-check.md's; the report links to it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import gpu_machine

from .criteria import criterion
from .processes import INSTALLED_SITES
from .settings import (
    DETERMINISTIC_SETTINGS,
    FAILED,
    MODEL_DESCRIPTIONS,
    PASSED,
    REPO,
    REVIEW,
    SKIPPED,
    sizes_of,
    tolerances_of,
)
from .units import CHECKS


@dataclass(frozen=True)
class Run:
    """What the report says about the run itself."""

    mode: str  # "gpu" or "dry"
    started: datetime.datetime
    clock: float  # time.time() at the start
    budget: float
    jobs: int
    gpus: int
    model: str
    imported: dict[str, dict[str, Any]] | None  # the import check's answer (None where it did not run)


def build(run: Run, rows: list[dict]) -> dict[str, Any]:
    """The report of ``run`` with its ``rows`` (in report order)."""
    dry = run.mode == "dry"
    counts = {status: sum(row["status"] == status for row in rows) for status in (PASSED, FAILED, SKIPPED)}
    tolerances, sizes = tolerances_of(dry, run.model), sizes_of(dry, run.model)
    return {
        "check": "flair-fabric GPU check (benchmarks/gpu_check.py, issue 20)",
        "mode": run.mode,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_utc": run.started.isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - run.clock, 1),
        "budget_seconds": run.budget,
        "jobs": run.jobs,
        "visible_gpus": run.gpus,
        "machine": gpu_machine(run.imported, INSTALLED_SITES, REPO / "flair_fabric"),
        "model": {"kind": run.model, "description": MODEL_DESCRIPTIONS[run.model]},
        "sizes": {kind: dataclasses.asdict(value) for kind, value in sizes.items()},
        "tolerances": dataclasses.asdict(tolerances),
        "deterministic_settings": DETERMINISTIC_SETTINGS,
        "criteria": {check.name: criterion(check.name, tolerances, sizes, dry) for _, check in CHECKS},
        "summary": counts,
        "checks": rows,
        "cuda_review": REVIEW,
    }


def write(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``out/gpu_check.json`` and ``out/README.md``; the report."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "README.md").write_text(render_markdown(report), encoding="utf-8")
    return report


# --- markdown -------------------------------------------------------------------------------------------------------


def cell(text: Any, limit: int = 400) -> str:
    """``text`` on one line, cut to ``limit`` characters, for a table cell."""
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def results_table(rows: list[dict]) -> str:
    """Every check: status, seconds, reason."""
    lines = ["| check | status | s | result |", "|---|---|---|---|"]
    for row in rows:
        seconds = row.get("seconds")
        shown = f"{seconds:.1f}" if isinstance(seconds, int | float) else ""
        lines.append(f"| {row['name']} | **{row['status']}** | {shown} | {cell(row['reason'])} |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    """Peak GPU memory of every configuration that trained."""
    entries = [
        (label, value)
        for row in rows
        for label, value in (row.get("measurements", {}).get("memory") or {}).items()
        if value is not None
    ]
    if not entries:
        return "Not measured (no CUDA device in this run)."
    lines = ["| configuration | peak MiB (max_memory_allocated) |", "|---|---|"]
    lines += [f"| {cell(label)} | {value:.0f} |" for label, value in entries]
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    """The throughput checks' samples/s, ratio and synchronisations per step."""
    lines = [
        "| batch | flair samples/s | FabricTrainer samples/s | time ratio fabric/flair | goal | syncs/step flair |"
        " syncs/step fabric |",
        "|---|---|---|---|---|---|---|",
    ]
    found = False
    for row in rows:
        m = row.get("measurements", {})
        if not row["name"].startswith("throughput_") or "samples_per_second" not in m:
            continue
        found = True
        syncs = m.get("syncs_per_step") or {}
        flair_syncs = (syncs.get("flair") or {}).get("median_per_step", "n/a")
        fabric_syncs = (syncs.get("fabric") or {}).get("median_per_step", "n/a")
        goal = m.get("goal_ratio") or "GPU only"
        lines.append(
            f"| {m['batch']} | {m['samples_per_second']['flair']} | {m['samples_per_second']['fabric']} |"
            f" **{m['time_ratio_fabric_over_flair']:.3f}** | {goal} | {flair_syncs} | {fabric_syncs} |"
        )
    return "\n".join(lines) if found else "Not measured in this run."


def one_gpu_table(rows: list[dict]) -> str:
    """The one-GPU probes: works or not, and the answer."""
    lines = ["| combination | works | answer |", "|---|---|---|"]
    found = False
    for row in rows:
        if not row["name"].startswith("one_gpu_"):
            continue
        found = True
        works = row.get("measurements", {}).get("works")
        shown = "yes" if works else ("no" if works is False else "-")
        lines.append(f"| {row['title']} | {shown} | {cell(row['reason'], 300)} |")
    return "\n".join(lines) if found else "Not run."


def key_versions(machine: dict) -> str:
    """torch, lightning, flair, transformers (and tokenizers, huggingface_hub): as the units import them where the
    import check ran, else from the distributions' metadata."""
    imported = machine.get("imported") or {}
    names = ("torch", "lightning", "flair", "transformers", "tokenizers", "huggingface_hub")
    shown = []
    for name in names:
        version = (imported.get(name) or {}).get("version") or machine["versions"].get(name.replace("_", "-"))
        shown.append(f"{name} {version}")
    source = "as imported by the units" if imported else "distribution metadata"
    wheels = machine.get("wheels_installed_in") or []
    carried = f"; carried wheels installed in {', '.join(wheels)}, first on the path" if wheels else ""
    return f"{', '.join(shown)} ({source}{carried}); flair_fabric from {machine['flair_fabric_from']}"


def criteria_table(rows: list[dict], criteria: dict[str, str]) -> str:
    """Every check with its status and when it passes."""
    lines = ["| check | status | passes when |", "|---|---|---|"]
    lines += [f"| {row['name']} | {row['status']} | {cell(criteria.get(row['name'], ''), 700)} |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    """README.md of the report."""
    rows = report["checks"]
    machine = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    gpus = "; ".join(machine["gpus"]) or "none"
    recorded = next(
        (r["measurements"].get("deterministic_settings") for r in rows if r["name"] == "parity_one_device"), None
    )
    settings = recorded or report["deterministic_settings"]
    settings_source = (
        "as the parity run recorded them" if recorded else "as the script sets them (the parity run recorded none)"
    )
    counts = report["summary"]
    model = report["model"]
    mode_line = (
        "CPU dry run: a few dozen TREC questions, gloo; CUDA-only checks are skipped"
        if report["mode"] == "dry"
        else "GPU run: fine-tuning on TREC"
    )
    processes = "all units in one process" if report["mode"] == "dry" else f"{report['jobs']} units at a time"
    parts = [
        "# flair-fabric GPU check",
        "",
        f"`{report['command']}` ({mode_line}). Started {report['started_utc']}, {report['wall_seconds']} s wall time"
        f" of a {report['budget_seconds']:.0f} s budget, {processes} (timing units alone).",
        "",
        f"**Model: {model['description']}.**",
        "",
        f"**Versions: {key_versions(machine)}.**",
        "",
        f"Machine: {machine['platform']}, Python {machine['python']}, {machine['cpu_count']} CPUs; GPUs: {gpus};"
        f" CUDA {machine['torch_cuda']}, NCCL {machine['nccl']}; distributions first on the path: {versions}.",
        "",
        f"**{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped.** Every check's numbers are in"
        " `gpu_check.json` (measurements), each unit's output in `logs/`.",
        "",
        results_table(rows),
        "",
        "## Peak GPU memory per configuration",
        "",
        "`torch.cuda.max_memory_allocated`, reset before each configuration; multi-process runs: global rank 0.",
        "",
        memory_table(rows),
        "",
        "## Throughput: flair's ModelTrainer vs FabricTrainer(devices=1)",
        "",
        "Training part of one epoch (both trainers timed by the same plugin, device synchronised at both ends), fresh"
        " seeded model per run, same batches (shuffle=False), ABBA order; syncs: `torch.cuda.set_sync_debug_mode"
        "('warn')` warnings per training step (median over the steps).",
        "",
        throughput_table(rows),
        "",
        "## Several processes on one GPU",
        "",
        one_gpu_table(rows),
        "",
        "## Checks and criteria",
        "",
        criteria_table(rows, report["criteria"]),
        "",
        f"## Deterministic settings of the parity and precision runs ({settings_source})",
        "",
        "\n".join(f"- `{k}`: {v}" for k, v in settings.items()),
        "",
        "## CUDA-only code paths a CPU test cannot catch (review)",
        "",
        "The review of the package's CUDA-only code paths (read from its source and flair's trainer; each finding"
        f" names the functions and the check that covers it) is kept in the repository's documentation: `{REVIEW}`.",
        "",
        "## Rerun",
        "",
        "`python benchmarks/gpu_check.py` on a CUDA machine (at most 8 minutes; `--only NAME,...` for some checks,"
        " `--budget S`, `--jobs N`); `python benchmarks/gpu_check.py --dry` (under a minute on 2 CPU cores) checks the"
        " script itself on CPU.",
        "",
    ]
    return "\n".join(parts)
