"""The prepared GPU check (benchmarks/gpu_check.py): its CPU dry run passes, and without CUDA it refuses to run."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
GPU_RESULTS = REPO / "benchmarks" / "results" / "gpu"
DRY_RUN_TIMEOUT_S = 300  # the dry run takes about 15 s on 2 CPU cores; its own budget is 150 s
# checks the dry run must run (and pass) on CPU; every other check is CUDA-only there
CPU_CHECKS = {
    "throughput_batch_32",
    "throughput_batch_128",
    "evaluate_vs_flair",
    "parity_one_device",
    "precision_32_true",
    "precision_bf16_mixed",
    "precision_bf16_true",
    "precision_use_amp",
    "strategy_lightning_fsdp_object",
    "strategy_fsdp",
    "strategy_ddp_2_processes",
    "language_model_parity",
    "language_model_bf16_mixed",
}


def run_gpu_check(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python benchmarks/gpu_check.py ARGS`` in a fresh interpreter, offline, outside any launcher."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    environment.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One dry run for all the tests of this module."""
    out = tmp_path_factory.mktemp("gpu-check-dry")
    return run_gpu_check("--dry", "--out", str(out), timeout=DRY_RUN_TIMEOUT_S), out


def files_of(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its SHA-256: whether anything was written there, changed or removed."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def report_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))


@pytest.mark.multiprocess
def test_dry_run_exits_0_and_writes_json_and_markdown(dry_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    completed, out = dry_run
    report = report_of(out)
    assert report["summary"]["failed"] == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    assert completed.returncode == 0, "no check failed: exit code 0"
    assert report["mode"] == "dry"
    assert (out / "README.md").read_text(encoding="utf-8").startswith("# flair-fabric GPU check")
    assert report["wall_seconds"] < report["budget_seconds"]


@pytest.mark.multiprocess
def test_dry_run_passes_every_cpu_check(dry_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    _, out = dry_run
    checks = {check["name"]: check for check in report_of(out)["checks"]}
    assert set(checks) >= CPU_CHECKS
    for name in CPU_CHECKS:
        assert not checks[name]["cuda_only"], name
        assert checks[name]["status"] == "passed", (name, checks[name]["reason"])


@pytest.mark.multiprocess
def test_dry_run_skips_every_cuda_check_with_a_reason(dry_run: tuple[subprocess.CompletedProcess, Path]) -> None:
    _, out = dry_run
    cuda_checks = [check for check in report_of(out)["checks"] if check["name"] not in CPU_CHECKS]
    assert cuda_checks, "the CUDA-only checks are listed"
    markdown = (out / "README.md").read_text(encoding="utf-8")
    for check in cuda_checks:
        assert check["cuda_only"], check["name"]
        assert check["status"] == "skipped", (check["name"], check["reason"])
        assert check["reason"].startswith("CUDA only: ") and len(check["reason"]) > len("CUDA only: "), check
        assert f"| {check['name']} | **skipped** |" in markdown, check["name"]


# Python imports sitecustomize from the path at start-up: in the worker process of the unit named by
# GPU_CHECK_TEST_FAIL_UNIT (``--worker <units>`` on its command line) it ends the process at once, before the unit
# reports anything; every other process runs as usual.
FAILING_UNIT_SITECUSTOMIZE = """
import os
failing = os.environ.get("GPU_CHECK_TEST_FAIL_UNIT")
if failing:
    with open("/proc/self/cmdline", "rb") as stream:
        arguments = stream.read().decode().split("\\0")
    if "--worker" in arguments and failing in arguments[arguments.index("--worker") + 1].split(","):
        os._exit(1)
"""


def test_a_failed_check_makes_the_run_exit_1(tmp_path: Path) -> None:
    """``--dry --only evaluate_vs_flair,strategy_lightning_fsdp_object --jobs 2``, with the evaluate unit's process
    ending at once (so it reports nothing): that check is reported failed, the other passed, and the exit code is 1
    (the clean dry run's 0 is checked above)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_UNIT_SITECUSTOMIZE, encoding="utf-8")
    python_path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = tmp_path / "out"
    completed = run_gpu_check(
        "--dry",
        "--only",
        "evaluate_vs_flair,strategy_lightning_fsdp_object",
        "--jobs",
        "2",
        "--out",
        str(out),
        timeout=DRY_RUN_TIMEOUT_S,
        env={"PYTHONPATH": python_path, "GPU_CHECK_TEST_FAIL_UNIT": "evaluate"},
    )
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    checks = {check["name"]: check["status"] for check in report_of(out)["checks"]}
    assert checks == {"evaluate_vs_flair": "failed", "strategy_lightning_fsdp_object": "passed"}, output
    assert completed.returncode == 1, output


def test_without_cuda_and_without_dry_exits_2_at_once(tmp_path: Path) -> None:
    committed = files_of(GPU_RESULTS)
    started = time.perf_counter()
    completed = run_gpu_check("--out", str(tmp_path / "out"), timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert time.perf_counter() - started < 60, "at once"  # importing torch: a few seconds
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "no CUDA device: run make gpu-check-dry for the CPU dry run" in completed.stderr
    assert "unit(s), budget" not in completed.stdout, "no unit was planned, let alone started"
    assert not (tmp_path / "out").exists()
    assert files_of(GPU_RESULTS) == committed, "nothing written into benchmarks/results/gpu"


@pytest.mark.parametrize("spelled", ["results/gpu", "results/gpu/../gpu", "results/gpu/logs"])
def test_dry_run_refuses_to_write_into_the_gpu_results(spelled: str) -> None:
    committed = files_of(GPU_RESULTS)
    completed = run_gpu_check("--dry", "--out", str(SCRIPT.parent / spelled), timeout=120)
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "--dry must not write into" in completed.stderr and "pass another --out" in completed.stderr
    assert files_of(GPU_RESULTS) == committed, "nothing written into benchmarks/results/gpu"
