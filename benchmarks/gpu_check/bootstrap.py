"""Before any unit starts: the GPUs this process sees, the carried wheels (``--install-wheels`` into /tmp/site) and
the import check (flair and flair_fabric importable as a unit's process would import them)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .processes import INSTALLED_SITES, python_path, worker_env
from .settings import IMPORT_CHECK_TIMEOUT_S, INSTALL_TIMEOUT_S, REPO

IMPORT_CHECK_MODULES = (
    "torch",
    "lightning",
    "transformers",
    "tokenizers",
    "huggingface_hub",
    "flair",
    "flair.datasets",
    "flair.embeddings",
    "flair.models",
    "flair.trainers",
    "flair_fabric",
)


class NotReady(Exception):
    """The environment cannot run the check (wheels, imports): exit code ``NOT_READY`` with the message."""


def visible_gpus() -> int:
    """CUDA devices this process sees, without creating a CUDA context (NVML); 0 where torch is not importable."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} cannot import torch", file=sys.stderr)
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def install_wheels(wheels: Path, site: Path) -> None:
    """``pip install --no-index --no-deps --target SITE`` of every wheel in ``wheels`` (what the GPU machine's image
    lacks: benchmarks/gpu_wheels.sh), then SITE first on this process's path and on its children's PYTHONPATH (so the
    carried transformers 4.x shadows the image's 5.x)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise NotReady(
            f"--install-wheels: no wheels in {wheels}. Run benchmarks/gpu_wheels.sh where PyPI is reachable (it"
            " downloads flair 0.15.1 and what the GPU machine's image lacks into .whl/), and carry .whl."
        )
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
    command += ["--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    started = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise NotReady(f"--install-wheels: pip did not finish within {INSTALL_TIMEOUT_S:.0f} s") from None
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr).strip()[-2000:]
        raise NotReady(
            f"--install-wheels: `pip install ... --target {site}` failed (exit {completed.returncode}):\n{output}"
        )
    print(f"installed {len(found)} wheels from {wheels} into {site} ({time.perf_counter() - started:.0f} s)")
    INSTALLED_SITES.insert(0, str(site))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = python_path()


IMPORT_CHECK_CODE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    if "." not in name:
        found[name] = {"version": getattr(module, "__version__", None), "file": getattr(module, "__file__", None)}
print("IMPORTED " + json.dumps(found))
"""


def import_check(dry: bool, jobs: int, log: Path) -> dict[str, dict[str, Any]]:
    """Import flair, flair_fabric and the libraries as a unit's process would; their versions and files, or
    ``NotReady`` with the error."""
    command = [sys.executable, "-c", IMPORT_CHECK_CODE, *IMPORT_CHECK_MODULES]
    env = worker_env(dry, jobs, {})
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=IMPORT_CHECK_TIMEOUT_S, env=env, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        raise NotReady(f"importing flair and flair_fabric took more than {IMPORT_CHECK_TIMEOUT_S:.0f} s") from None
    log.write_text(completed.stdout + completed.stderr, encoding="utf-8")
    line = next((x for x in completed.stdout.splitlines() if x.startswith("IMPORTED ")), None)
    if completed.returncode != 0 or line is None:
        error = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
        where = f" with the wheels installed in {', '.join(INSTALLED_SITES)}" if INSTALLED_SITES else ""
        raise NotReady(
            f"flair or flair_fabric cannot be imported by {sys.executable}{where}: {error}\n(full output: {log})\n"
            "On the GPU machine: run benchmarks/gpu_wheels.sh here first (where PyPI is reachable), carry .whl, and"
            " pass --install-wheels (make gpu-check does)."
        )
    return json.loads(line.removeprefix("IMPORTED "))
