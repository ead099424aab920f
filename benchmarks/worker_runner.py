"""How ``benchmarks/run.py`` runs a measurement: ``worker.py MODE`` in a fresh process (group) with one
environment, its output in a log file, its JSON result read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from plans import Job

WORKER = Path(__file__).resolve().parent / "worker.py"


class Runner:
    """Starts worker processes with one environment and collects their JSON output."""

    def __init__(self, threads: int, timeout: float, work_dir: Path, verbose: bool) -> None:
        self.threads = threads
        self.timeout = timeout
        self.work_dir = work_dir
        self.verbose = verbose
        self.count = 0

    def run(self, mode: str, job: Job, extra: list[str] | None = None, threads: int | None = None) -> dict[str, Any]:
        self.count += 1
        threads = threads or self.threads
        out = self.work_dir / f"{self.count:02d}-{mode}-{job.model}.json"
        log_path = out.with_suffix(".log")
        command = [sys.executable, str(WORKER), mode, *job.worker_args(), f"--out={out}", *(extra or [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.pop("LOCAL_RANK", None)  # a worker that sees LOCAL_RANK would not start its own processes
        started, started_at = time.perf_counter(), time.time()
        with log_path.open("w", encoding="utf-8") as log_file:
            process = subprocess.Popen(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the worker and the ranks it started, nothing else
                process.wait()
        wall = time.perf_counter() - started
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        progress = [
            line
            for line in log_text.splitlines()
            if line.startswith(
                (
                    "[overhead ",
                    "[fabric ",
                    "[native ",
                    "[evaluate ",
                    "[sharding ",
                    "[checkpointing ",
                    "[whole-",
                    "[bare",
                )
            )
        ]
        for line in progress if self.verbose else progress[-1:]:
            print(f"    {line}", flush=True)
        if process.returncode != 0 or not out.exists():
            tail = "\n".join(log_text.splitlines()[-40:])
            raise RuntimeError(f"worker failed (exit {process.returncode}): {' '.join(command)}\n{tail}")
        result = json.loads(out.read_text(encoding="utf-8"))
        result["process_wall_seconds"] = round(wall, 1)
        result["process_started_at"] = started_at
        return result
