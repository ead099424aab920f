"""The pieces that end a job cleanly: signals held until the ranks agree, no rank outliving its starter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flair_fabric.launch.failures import FORWARDED_SIGNAL, graceful_interrupts, stop_started_processes

ORPHAN = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import time
from flair_fabric.launch.failures import exit_with_parent
exit_with_parent(poll_seconds=0.1)
print("watching", flush=True)
time.sleep(60)
'''], stdout=sys.stdout)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_started_rank_exits_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "watching"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the child must exit once its parent is gone"


def test_rank_zero_stops_the_processes_it_started() -> None:
    started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[started])))
    stop_started_processes(fabric)  # type: ignore[arg-type]
    assert started.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGINT, signal.SIGTERM),
        (signal.SIGTERM, signal.SIGINT),
    ],
    ids=["SIGINT-SIGINT", "SIGTERM-SIGTERM", "SIGINT-SIGTERM", "SIGTERM-SIGINT"],
)
def test_the_first_signal_is_held_the_second_one_interrupts(first: signal.Signals, second: signal.Signals) -> None:
    """The first SIGINT or SIGTERM is held (training goes on until the ranks agree); a second one, the same signal or
    the other, raises KeyboardInterrupt at once."""
    received: list[str] = []

    def not_held(signum: int, frame: object) -> None:  # what runs if the block leaves this signal alone
        raise AssertionError(f"{signal.Signals(signum).name} was not held by graceful_interrupts")

    before = {number: signal.signal(number, not_held) for number in (signal.SIGINT, signal.SIGTERM)}
    # (instead of the default actions, which end pytest itself)
    with pytest.raises(KeyboardInterrupt, match="received a second time"), graceful_interrupts(received.append):
        os.kill(os.getpid(), first)
        time.sleep(0.1)  # the handler runs here; training would go on until the ranks agree
        assert received == [first.name]
        os.kill(os.getpid(), second)
        time.sleep(1)
    assert all(signal.getsignal(number) is not_held for number in before), "the previous handlers are back"
    for number, handler in before.items():
        signal.signal(number, handler)


@pytest.mark.parametrize("arrival", ["passed on first", "itself first", "both at once"])
def test_one_ctrl_c_that_reaches_a_worker_itself_and_passed_on_is_held_once(arrival: str) -> None:
    """A Ctrl-C in a terminal reaches a worker itself and, passed on by its caller, as FORWARDED_SIGNAL; the worker
    may handle either first (under load both are pending at once, and one handler runs inside the other). Only a
    second Ctrl-C stops it at once: otherwise one rank stops alone and the others wait for it forever."""
    received: list[str] = []
    held = False
    ctrl_c = {signal.SIGINT, FORWARDED_SIGNAL}
    with pytest.raises(KeyboardInterrupt, match="SIGINT received a second time"), graceful_interrupts(received.append):
        if arrival == "both at once":
            signal.pthread_sigmask(signal.SIG_BLOCK, ctrl_c)
        first, then = (FORWARDED_SIGNAL, signal.SIGINT)
        if arrival == "itself first":
            first, then = then, first
        os.kill(os.getpid(), first)
        time.sleep(0.1)
        os.kill(os.getpid(), then)
        time.sleep(0.1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ctrl_c)
        time.sleep(0.1)
        held = received == ["SIGINT"]
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again
        time.sleep(1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ctrl_c)
    assert held, f"one Ctrl-C is told once and held, not taken for a second one (told: {received})"


def test_a_signal_held_by_an_outer_block_is_told_to_a_block_that_begins_later() -> None:
    """A Ctrl-C during a worker's set-up is held by the worker's outer block; the training's own block, which begins
    later, is told of it at once and stops at its first agreement point (docs/notebooks.md)."""
    outer: list[str] = []
    inner: list[str] = []
    with graceful_interrupts(outer.append):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert outer == ["SIGINT"]
        with graceful_interrupts(inner.append):
            assert inner == ["SIGINT"], "the block that begins after the signal is told of it at once"
