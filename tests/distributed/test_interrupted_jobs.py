"""A Ctrl-C that reaches the caller alone (a notebook kernel) while forked workers run the language-model trainer,
predict or evaluate: the workers stop and are reaped, as for FabricTrainer (test_reliability.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ..support import SCRIPTS, expect_success
from .test_reliability import finish, start_process

pytestmark = pytest.mark.multiprocess


def _run(tmp_path: Path, job: str) -> object:
    command = [sys.executable, str(SCRIPTS / "interrupted_jobs.py"), str(tmp_path), job]
    started = time.monotonic()
    return finish(start_process(command, tmp_path / "job"), started, timeout=240)


def test_a_ctrl_c_to_the_caller_stops_the_language_model_workers_at_their_next_agreement(tmp_path: Path) -> None:
    job = _run(tmp_path, "lm")
    expect_success(job.returncode, "the job", job.stderr)
    assert "test scored: True" in job.stdout, job.stdout
    splits = int(job.stdout.split("stopped after ")[1].split()[0])
    assert 1 <= splits < 20, "stopped long before its 500 epochs"
    assert "SIGINT received by rank" in (tmp_path / "run" / "training.log").read_text()
    assert job.no_process_left()


@pytest.mark.parametrize("entry", ["predict", "evaluate"])
def test_two_ctrl_cs_to_the_caller_stop_and_reap_the_prediction_workers(tmp_path: Path, entry: str) -> None:
    job = _run(tmp_path, entry)
    expect_success(job.returncode, "the job", job.stderr)
    assert "interrupted: SIGINT received: the workers were stopped" in job.stdout, job.stdout + job.stderr[-2000:]
    assert job.no_process_left()
