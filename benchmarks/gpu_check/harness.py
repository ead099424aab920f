"""The harness: every unit in its own process (``gpu_check.py --worker UNIT``), ``--jobs`` at a time (timing units
alone), each within its budget and all within the global one; a unit that fails, crashes or hangs is killed and
reported while the others go on. The dry run merges its units into ``--jobs`` processes (one by default)."""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import report
from .bootstrap import NotReady, import_check, install_wheels, visible_gpus
from .context import CheckSpec, Unit, result
from .processes import kill_group, tail_of, worker_env
from .settings import (
    DEFAULT_OUT,
    DRY_BUDGET_S,
    FAILED,
    GPU_BUDGET_S,
    MIN_UNIT_START_S,
    MODEL_DESCRIPTIONS,
    NO_CUDA_MESSAGE,
    NOT_READY,
    PASSED,
    REPO,
    SCRIPT,
    SKIPPED,
    WHEEL_SITE,
    resolve_model,
)
from .units import CHECKS, UNITS, UNITS_BY_NAME


@dataclass
class Running:
    """The process of a batch of units (one unit on a GPU; the dry run merges them)."""

    units: tuple[Unit, ...]
    process: subprocess.Popen
    started: float
    timeout: float
    work: Path
    log: Path

    @property
    def name(self) -> str:
        return batch_name(self.units)

    @property
    def exclusive(self) -> bool:
        return any(unit.exclusive for unit in self.units)


def batch_name(units: tuple[Unit, ...]) -> str:
    """The name of a batch's process and log: the unit's, or "cpu_units" for the dry run's merged units."""
    return units[0].name if len(units) == 1 else "cpu_units"


def dry_batches(units: list[Unit], jobs: int) -> list[tuple[Unit, ...]]:
    """The dry run's units in ``jobs`` processes (one by default): each process pays the imports of torch, flair
    and Lightning (several seconds on a small CPU) once; units keep their order, balanced by their dry budgets."""
    loads = [0.0] * max(1, min(jobs, len(units)))
    batches: list[list[Unit]] = [[] for _ in loads]
    for unit in units:
        least = loads.index(min(loads))
        batches[least].append(unit)
        loads[least] += unit.dry_budget_s
    return [tuple(batch) for batch in batches if batch]


class Scheduler:
    """Runs the units in their own processes, ``jobs`` at a time (exclusive ones alone), within the budget; the dry
    run merges its units into ``jobs`` processes (``dry_batches``)."""

    def __init__(
        self, units: list[Unit], *, dry: bool, gpus: int, jobs: int, budget: float, out: Path, model: str
    ) -> None:
        self.units, self.dry, self.gpus, self.jobs, self.model = units, dry, gpus, jobs, model
        self.started = time.time()
        self.deadline = self.started + budget
        self.out = out
        self.session = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.rows: dict[str, dict] = {}

    def run(self) -> dict[str, dict]:
        """Every unit, run or skipped; the rows by check name."""
        for unit in self.units:  # units without a process here are reported at once
            if self.dry and unit.cuda_only:
                self._skip(unit, "CUDA only")
            elif not self.dry and self.gpus < unit.min_gpus:
                self._skip(unit, f"needs {unit.min_gpus} CUDA devices, {self.gpus} visible")
        runnable = [unit for unit in self.units if self._needs_process(unit)]
        pending = dry_batches(runnable, self.jobs) if self.dry else [(unit,) for unit in runnable]
        running: list[Running] = []
        try:
            while pending or running:
                running = [r for r in running if not self._reap(r)]
                while pending and self._can_start(pending[0], running):
                    started = self._start(pending.pop(0))
                    if started is not None:
                        running.append(started)
                time.sleep(0.2)
        finally:
            for r in running:
                kill_group(r.process)
                self._collect(r, "interrupted: the check was stopped")
            shutil.rmtree(self.session, ignore_errors=True)
        return self.rows

    def _can_start(self, batch: tuple[Unit, ...], running: list[Running]) -> bool:
        if len(running) >= self.jobs:
            return False
        if self.dry:  # the dry run judges no timings
            return True
        return not any(r.exclusive for r in running) and not (any(u.exclusive for u in batch) and running)

    def _needs_process(self, unit: Unit) -> bool:
        return not (self.dry and unit.cuda_only) and not (not self.dry and self.gpus < unit.min_gpus)

    def _skip(self, unit: Unit, reason: str) -> None:
        """Every check of ``unit`` skipped (CUDA-only ones in the dry run: for that reason)."""
        for check in unit.checks:
            cuda_only = self.dry and check.cuda_reason
            self._record(
                unit, check, result(check.name, SKIPPED, f"CUDA only: {check.cuda_reason}" if cuda_only else reason)
            )

    def _start(self, batch: tuple[Unit, ...]) -> Running | None:
        left = self.deadline - time.time()
        budget = sum(unit.dry_budget_s if self.dry else unit.budget_s for unit in batch)
        if left < min(MIN_UNIT_START_S, budget):
            for unit in batch:
                self._skip(unit, f"the global time budget was used up before this unit ({left:.0f} s left)")
            return None
        timeout = min(budget, left)
        name = batch_name(batch)
        work = self.session / name
        work.mkdir(parents=True)
        log = self.out / "logs" / f"{name}.log"
        command = [sys.executable, str(SCRIPT), "--worker", ",".join(u.name for u in batch)]
        command += ["--work", str(work), "--gpus", str(self.gpus), "--deadline", str(time.time() + timeout - 5)]
        command += ["--model", self.model] + (["--dry"] if self.dry else [])
        extra = {key: value for unit in batch for key, value in unit.env.items()}
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=worker_env(self.dry, self.jobs, extra),
                cwd=REPO,
                start_new_session=True,
            )
        units = ", ".join(unit.name for unit in batch)
        self._say(f"{name}: started (budget {timeout:.0f} s)" + (f": {units}" if len(batch) > 1 else ""))
        return Running(batch, process, time.time(), timeout, work, log)

    def _reap(self, r: Running) -> bool:
        """Collect a batch that ended or ran out of time; whether it is done."""
        code = r.process.poll()
        if code is None and time.time() - r.started > r.timeout:
            kill_group(r.process)
            self._collect(r, f"the unit's process was stopped after its budget of {r.timeout:.0f} s (hang or too slow)")
            return True
        if code is None:
            return False
        self._collect(r, f"the unit's process exited with code {code} before reporting this check")
        return True

    def _collect(self, r: Running, missing_reason: str) -> None:
        rows_file = r.work / "rows.jsonl"
        lines = rows_file.read_text(encoding="utf-8").splitlines() if rows_file.is_file() else []
        reported = {row["name"]: row for row in map(json.loads, lines)}
        log_tail = tail_of(r.log, 600)
        for unit in r.units:
            for check in unit.checks:
                row = reported.get(check.name)
                if row is None and self.dry and check.cuda_reason:
                    row = result(check.name, SKIPPED, f"CUDA only: {check.cuda_reason}")
                elif row is None:
                    row = result(check.name, FAILED, f"{missing_reason}; log logs/{r.name}.log: {log_tail}")
                self._record(unit, check, row)

    def _record(self, unit: Unit, check: CheckSpec, row: dict) -> None:
        row = {"name": check.name, **row, "title": check.title, "unit": unit.name}
        row["cuda_only"] = bool(check.cuda_reason)
        self.rows[check.name] = row
        self._say(f"{check.name}: {row['status']}" + (f" ({row['reason'][:100]})" if row["status"] != PASSED else ""))

    def _say(self, message: str) -> None:
        print(f"[{time.time() - self.started:6.1f} s] {message}", flush=True)


def select_units(only: str | None) -> list[Unit]:
    """All units, or those named in ``--only`` (unit names or check names)."""
    if not only:
        return list(UNITS)
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    known = set(UNITS_BY_NAME) | {check.name for _, check in CHECKS}
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"--only: unknown unit or check {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [unit for unit in UNITS if unit.name in wanted or any(c.name in wanted for c in unit.checks)]


def resolve_out(out: Path | None, dry: bool) -> Path:
    """The results folder: benchmarks/results/gpu on a GPU; a new temporary folder (or ``--out``) in the dry run,
    never the committed GPU results."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="gpu-check-dry-")) if dry else DEFAULT_OUT
    out = out.resolve()
    if dry and out.is_relative_to(DEFAULT_OUT.resolve()):  # the folder, however spelled, or one inside it
        raise SystemExit(f"--dry must not write into {DEFAULT_OUT} (the GPU results): pass another --out")
    return out


def orchestrate(args: argparse.Namespace) -> int:
    """The whole check: the GPUs, the wheels and the import check, every unit, the report; the exit code."""
    gpus = visible_gpus()
    if not args.dry and gpus == 0:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    out = resolve_out(args.out, args.dry)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in (out / "logs").glob("*.log"):
        old.unlink()
    units = select_units(args.only)
    jobs = args.jobs or (1 if args.dry else 3)
    budget = args.budget or (DRY_BUDGET_S if args.dry else GPU_BUDGET_S)
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.time()
    imported = None
    try:
        if args.install_wheels:
            install_wheels(args.wheels, WHEEL_SITE)
        if args.install_wheels or not args.dry:  # fail fast; the dry run's own environment is `make install`'s
            imported = import_check(args.dry, jobs, out / "logs" / "import_check.log")
    except NotReady as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return NOT_READY
    model = resolve_model(args.dry, args.model)
    mode = "dry" if args.dry else "gpu"
    print(f"gpu_check ({mode}): {len(units)} unit(s), budget {budget:.0f} s, {jobs} at a time, results in {out}")
    print(f"model: {MODEL_DESCRIPTIONS[model]}")
    left = budget - (time.time() - clock)  # the installs and the import check count
    scheduler = Scheduler(units, dry=args.dry, gpus=gpus, jobs=jobs, budget=left, out=out, model=model)
    rows = scheduler.run()
    ordered = [rows[check.name] for unit, check in CHECKS if unit in units and check.name in rows]
    run = report.Run(mode, started, clock, budget, jobs, gpus, model, imported)
    written = report.write(out, report.build(run, ordered))
    counts = written["summary"]
    print()
    print(report.results_table(ordered))
    print(f"\n{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped, {written['wall_seconds']} s")
    print(f"results: {out / 'gpu_check.json'} and {out / 'README.md'}")
    return 1 if counts[FAILED] else 0
