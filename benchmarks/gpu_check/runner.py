"""Inside a unit's process: run one unit (or, in the dry run, several one after the other), or one probe."""

from __future__ import annotations

import json
import os
import traceback
import warnings
from pathlib import Path

from common import quiet_flair

from .context import Context, result
from .settings import FAILED
from .units import PROBES, UNITS_BY_NAME


def quiet_logs() -> None:
    """flair's INFO lines and FutureWarnings off: the logs keep what matters."""
    quiet_flair()
    warnings.filterwarnings("ignore", category=FutureWarning)


def is_global_zero() -> bool:
    """False in the copies of a worker that Lightning's script relaunch starts for ranks > 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def run_worker(unit_names: str, work: Path, dry: bool, gpus: int, deadline: float, model: str) -> int:
    """Run one unit, or several (comma-separated, one after the other in this process: the dry run); global rank 0
    appends each row to ``work/rows.jsonl`` as soon as it is known. A unit that raises outside its checks gets a
    failed row for each check it did not report, and the next unit runs."""
    quiet_logs()
    ctx = Context(dry=dry, work=work, gpus=gpus, deadline=deadline, model=model)
    rows_file = work / "rows.jsonl"

    def write(unit_name: str, row: dict) -> None:
        if is_global_zero():
            with open(rows_file, "a", encoding="utf-8") as rows:
                rows.write(json.dumps(row, default=str) + "\n")
        print(f"[{unit_name}] {row['name']}: {row['status']} ({row.get('seconds', 0):.1f} s)", flush=True)

    for unit_name in unit_names.split(","):
        unit = UNITS_BY_NAME[unit_name]
        reported: set[str] = set()
        try:
            for row in unit.run(ctx):
                reported.add(row["name"])
                write(unit_name, row)
        except Exception as error:
            message = f"the unit {unit_name} stopped: {type(error).__name__}: {error}"[:1500]
            print(traceback.format_exc(), flush=True)
            for check in unit.checks:
                if check.name not in reported and not (dry and check.cuda_reason):
                    reported.add(check.name)
                    write(unit_name, result(check.name, FAILED, message))
        missing = [check.name for check in unit.checks if check.name not in reported]
        if missing:
            print(f"[{unit_name}] not run here: {', '.join(missing)}", flush=True)
    return 0


def run_probe_cli(probe: str, work: Path, dry: bool, gpus: int, deadline: float, model: str) -> int:
    """Run one probe and write its answer to ``work/answer.json``."""
    quiet_logs()
    ctx = Context(dry=dry, work=work, gpus=gpus, deadline=deadline, model=model)
    answer = PROBES[probe](ctx)
    if is_global_zero():
        (work / "answer.json").write_text(json.dumps(answer, default=str), encoding="utf-8")
    return 0
