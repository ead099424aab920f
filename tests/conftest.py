"""Test-wide settings, the shared two-rank training runs, and the mutation check's hooks."""

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before flair and transformers are imported
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("LOCAL_RANK", None)
# Ray (tests/elastic) on the loopback address only: else Ray replaces 127.0.0.1 in ray.init's addresses by this
# machine's address (read when Ray is imported: before any test module imports it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from .support import ANNEALED, GROUPED_BY_2, UNION, RunCrashed, RunHung, run_script, write_config


def pytest_configure(config: pytest.Config) -> None:
    """``make test`` runs the tests in 3 pytest-xdist workers on 2 cores: each computes on one CPU thread, as torch's
    DataLoader workers do (pools of 2 OpenMP threads on 2 cores wait for each other's threads). The processes a test
    starts keep torch's default."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_relaunch_of_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside pytest, Lightning's script relaunch would start pytest itself again, once per extra rank (and each copy
    again...): a test that trains on several processes in its own process uses forked or spawned workers; scripts
    that use the relaunch run in their own interpreter (``run_script``). A test whose refusal did not happen fails
    here (a crash, not a catch) instead of starting copies of the test session."""
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launch = _SubprocessScriptLauncher.launch

    def refuse_copies(self: _SubprocessScriptLauncher, function: Any, *args: Any, **kwargs: Any) -> Any:
        if self.num_processes > 1 and not self.cluster_environment.creates_processes_externally:
            raise RunCrashed("a test tried to relaunch pytest as its other ranks: use strategy='ddp_fork'")
        return launch(self, function, *args, **kwargs)  # one process (DDP at world size 1): nothing is started

    monkeypatch.setattr(_SubprocessScriptLauncher, "launch", refuse_copies)


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One user script, six trainings on 2 ranks started by the script relaunch (one process start-up)."""
    out = tmp_path_factory.mktemp("ddp")
    runs = [
        {"name": "union", "method": "train_custom", "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2}},
        {
            "name": "strided",
            "method": "train_custom",
            "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2, "balance_batches": False},
        },
        {
            "name": "union_shuffled",
            "method": "train_custom",
            "kwargs": {**UNION, "shuffle": True, "global_batch_size": 8, "devices": 2},
        },
        {
            "name": "union_grouped",
            "method": "train_custom",
            "kwargs": {**UNION, "shuffle": True, "global_batch_size": 8, "devices": 2, **GROUPED_BY_2},
        },
        {
            "name": "union_chunked",
            "method": "train_custom",
            "kwargs": {**UNION, "mini_batch_size": 4, "mini_batch_chunk_size": 2, "devices": 2},
        },
        {
            "name": "defaults",
            "method": "train",
            "kwargs": {"max_epochs": 3, "mini_batch_size": 4, "devices": 2},
            "listening": True,
            "rank_zero_return": True,  # a plugin adds a return value on global rank 0 only
        },
        {"name": "annealed", "method": "train", "kwargs": ANNEALED},
    ]
    config = write_config(out / "config.json", {"out": str(out), "runs": runs})
    run_script("ddp_runs.py", str(config))
    return out


# --- the mutation check (tests/mutation_check.py) -------------------------------------------------------------------
# FLAIR_FABRIC_VERDICT=<file>: every failing test is written to <file> with the kind of its failure; the first that
# counts (an assertion of the tests' own code, an expected error: pytest.raises that did not raise, or a pytest.fail of
# a test) ends the session. A crash (an error from the code under test or from a process the test started, a fixture
# error, a collection error) does not count and the session goes on. A timeout counts only with
# FLAIR_FABRIC_HANG_COUNTS=1 (the claims about hanging).
# FLAIR_FABRIC_TESTS_FIRST=<id>,<id>: run these tests (node ids or their prefixes) first, the rest in their order.

TESTS = Path(__file__).resolve().parent
# code that raises AssertionError on a test's behalf (pytest.raises' match, pytest.approx in an assert)
ASSERTING_LIBRARIES = ("/_pytest/", "/pluggy/", "/torch/testing/", "/numpy/testing/")
COUNTED_KINDS = ("assertion", "expected error")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    first = [prefix for prefix in os.environ.get("FLAIR_FABRIC_TESTS_FIRST", "").split(",") if prefix]
    if first:
        rank = {
            id(item): min((i for i, p in enumerate(first) if item.nodeid.startswith(p)), default=len(first))
            for item in items
        }
        items.sort(key=lambda item: rank[id(item)])  # stable: the rest keep their order


def raised_in_test_code(excinfo: pytest.ExceptionInfo) -> bool:
    """Whether the innermost frame of the traceback that is not pytest's or an assertion library's lies in tests/."""
    for entry in reversed(excinfo.traceback):
        path = str(entry.path)
        if not any(library in path for library in ASSERTING_LIBRARIES):
            return Path(path).resolve().is_relative_to(TESTS)
    return False


def failure_kind(excinfo: pytest.ExceptionInfo, when: str) -> str:
    """What a test's failure is: ``assertion`` (an assert of the tests' own code), ``expected error`` (pytest.raises
    that did not raise, a pytest.fail of a test), ``timeout`` (pytest-timeout, or a process that did not end:
    :class:`~tests.support.RunHung`) or ``crashed`` (anything else: an error of the code under test or of a process
    the test started, :class:`~tests.support.RunCrashed`, an error in a fixture)."""
    if excinfo.errisinstance(RunHung) or (
        excinfo.errisinstance(pytest.fail.Exception) and str(excinfo.value).startswith("Timeout")
    ):
        return "timeout"
    if when != "call":
        return "crashed"
    if excinfo.errisinstance(pytest.fail.Exception):
        return "expected error"
    if excinfo.errisinstance(AssertionError) and raised_in_test_code(excinfo):
        return "assertion"
    return "crashed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    verdict = os.environ.get("FLAIR_FABRIC_VERDICT")
    report = outcome.get_result()
    if not verdict or not report.failed or call.excinfo is None:
        return
    kind = failure_kind(call.excinfo, report.when)
    counts = kind in COUNTED_KINDS or (kind == "timeout" and os.environ.get("FLAIR_FABRIC_HANG_COUNTS") == "1")
    message = f"{call.excinfo.typename}: {(str(call.excinfo.value).splitlines() or [''])[0]}"[:300]
    record = {"test": item.nodeid, "kind": kind, "counts": counts, "message": message}
    with open(verdict, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")
    if counts:
        item.session.shouldstop = f"caught by {item.nodeid} ({kind})"
