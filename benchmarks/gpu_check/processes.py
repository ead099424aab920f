"""Processes: the environment of a unit's process, killing a process group, and running one probe in a fresh
interpreter with a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .context import Context
from .settings import REPO, SCRIPT

LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "ROLE_RANK")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_", "PMI_", "OMPI_")
INSTALLED_SITES: list[str] = []  # folders --install-wheels put first on the path of this process and its children


def kill_group(process: subprocess.Popen) -> None:
    """Kill a process started with ``start_new_session=True`` and every process it started; reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.wait(timeout=10)


def tail_of(path: Path, characters: int = 1500) -> str:
    """The end of a log file ("" if it cannot be read)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-characters:]
    except OSError:
        return ""


def worker_env(dry: bool, jobs: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a unit: offline, no launcher variables of the caller (every check starts its own
    processes), the installed wheels (``--install-wheels``) and the working tree first on the path, CPU only and a
    share of the cores in the dry run."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)
    }
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # no CUDA context before a process needs one
            "PYTHONPATH": python_path(),
        }
    )
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # one thread: tiny models gain nothing from more, and ranks forked (ddp_fork) from a process whose OpenMP
        # pool has several threads can hang in their first parallel region
        env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def python_path() -> str:
    """PYTHONPATH of the processes this script starts: the wheels' folder (if installed), the working tree (flair_fabric
    is not pip-installed on the GPU machine), then the caller's PYTHONPATH."""
    entries = [*INSTALLED_SITES, str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(entry for entry in entries if entry))


def run_probe(ctx: Context, probe: str, timeout: float, dropped_env: tuple[str, ...] = ()) -> dict:
    """Run one probe in a fresh interpreter (its own process group, without the variables ``dropped_env``) with a
    timeout; its JSON answer or what failed."""
    work = ctx.work / f"probe-{probe}"
    work.mkdir(parents=True, exist_ok=True)
    answer = work / "answer.json"
    command = [sys.executable, str(SCRIPT), "--probe", probe, "--work", str(work)]
    command += ["--deadline", str(time.time() + timeout), "--gpus", str(ctx.gpus), "--model", ctx.model]
    command += ["--dry"] if ctx.dry else []
    env = {k: v for k, v in os.environ.items() if k not in dropped_env}
    started = time.perf_counter()
    with open(work / "output.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            kill_group(process)
            returncode = None
    seconds = round(time.perf_counter() - started, 1)
    tail = tail_of(work / "output.log")
    payload = json.loads(answer.read_text(encoding="utf-8")) if answer.is_file() else None
    if returncode is None:
        outcome = "timeout"
    elif payload is None:
        outcome = "crashed"
    else:
        outcome = "finished"
    return {"outcome": outcome, "returncode": returncode, "seconds": seconds, "payload": payload, "output_tail": tail}


def probe_failure(outcome: dict) -> str:
    """Why a probe gave no answer."""
    if outcome["outcome"] == "timeout":
        return f"no answer within {outcome['seconds']:.0f} s: a hang, not a clear error"
    return f"the probe process died (exit {outcome['returncode']}) without an answer: {outcome['output_tail'][-600:]}"
