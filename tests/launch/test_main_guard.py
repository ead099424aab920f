"""A script without ``if __name__ == "__main__":`` that trains with spawned workers: each worker imports the script
again and starts the run at module level. The run must end at once with the guard message (Lightning's), never wait
for workers that are gone, even when the job the workers receive is larger than a pipe buffer."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.fabric.strategies.launchers.multiprocessing import _check_missing_main_guard

from flair_fabric.launch import transport

from ..support import REPO, SCRIPTS, RunHung, processes, script_env, small_trec

pytestmark = pytest.mark.multiprocess

TRAIN_SIZE = 1000
"""TREC questions in the script's corpus: a job of some 900 KiB, many times a pipe's buffer."""

LIMIT_SECONDS = 60


def _lightnings_words() -> str:
    """What Lightning says in a spawned process that starts processes while it imports the script (its first
    sentence, spaces normalised)."""
    process = multiprocessing.current_process()
    process._inheriting = True  # type: ignore[attr-defined]  # multiprocessing's mark of a spawned process's import
    try:
        with pytest.raises(RuntimeError) as refused:
            _check_missing_main_guard()
    finally:
        del process._inheriting  # type: ignore[attr-defined]
    return " ".join(str(refused.value).split()).split(". ")[0]


def _pipe_buffer() -> int:
    read, write = os.pipe()
    try:
        return fcntl.fcntl(write, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(read)
        os.close(write)


def _left_in(group: int) -> list[int]:
    """The live processes of a process group, waiting up to 10 s for them to end."""
    deadline = time.monotonic() + 10
    while True:
        left = [each.pid for each in processes() if each.group == group and each.state != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_a_script_without_a_main_guard_ends_with_the_guard_message_instead_of_waiting(tmp_path: Path) -> None:
    """The script exits non-zero within a minute, the caller's own error (the last traceback) says to guard the main
    function as Lightning says it, nothing was trained and no process of the run is left."""
    job = transport.dumps(small_trec(train_size=TRAIN_SIZE))
    assert len(job) > 4 * _pipe_buffer(), "the corpus is too small to fill a pipe buffer: the test proves nothing"
    command = [sys.executable, str(SCRIPTS / "unguarded_spawn.py"), str(tmp_path / "out"), str(TRAIN_SIZE)]
    began = time.monotonic()
    script = subprocess.Popen(
        command,
        env=script_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the workers too, to find (and end) what is left
    )
    try:
        output, _ = script.communicate(timeout=LIMIT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)
        output, _ = script.communicate()
        raise RunHung(f"the script did not end within {LIMIT_SECONDS} s: {output[-3000:]}") from None
    seconds = time.monotonic() - began
    left = _left_in(script.pid)
    if left:
        os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode not in (0, None), output[-3000:]
    assert "TRAINED" not in output
    callers_error = output.rsplit("Traceback (most recent call last):", 1)[-1]
    assert _lightnings_words() in " ".join(callers_error.split()), output[-3000:]
    assert not left, f"processes of the run left {seconds:.0f} s after the start: {left}"
