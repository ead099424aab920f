"""An ``mpi4py`` without a working MPI launcher must not kill a run: Fabric's cluster detection initialises MPI in
every process, and Open MPI aborts the process when it cannot start its daemon (the GPU check's machine). The fake
``mpi4py`` below aborts the same way when its ``MPI`` module is imported, unless ``FAKE_MPI_SIZE`` is set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..support import REPO, expect_success

ABORT_CODE = 86
FAKE_MPI = """
import os
import sys

if "FAKE_MPI_SIZE" not in os.environ:  # what Open MPI does without a daemon: message, then abort
    sys.stderr.write("It looks like MPI_INIT failed for some reason (fake mpi4py)\\n")
    os._exit({code})


class _World:
    def Get_size(self):
        return int(os.environ["FAKE_MPI_SIZE"])

    def Get_rank(self):
        return 0


COMM_WORLD = _World()
"""


def _fake_mpi4py(folder: Path) -> Path:
    package = folder / "mpi4py"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "MPI.py").write_text(FAKE_MPI.format(code=ABORT_CODE), encoding="utf-8")
    metadata = folder / "mpi4py-4.0.0.dist-info"  # Lightning looks for the installed distribution
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: mpi4py\nVersion: 4.0.0\n", encoding="utf-8")
    return folder


def _run(code: str, site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    variables = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "FAKE_MPI_SIZE")}
    variables.update({"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1", **env})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=variables,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_the_fake_aborts_like_open_mpi_when_lightning_detects_the_cluster(tmp_path: Path) -> None:
    """The reference: Lightning's own detection, with this fake installed, ends the process."""
    site = _fake_mpi4py(tmp_path / "site")
    completed = _run("from lightning.fabric import Fabric; Fabric(accelerator='cpu', devices=1)", site)
    assert completed.returncode == ABORT_CODE, completed.stderr[-2000:]
    assert "MPI_INIT failed" in completed.stderr


@pytest.mark.multiprocess
def test_training_with_mpi4py_installed_but_no_mpi_launcher(tmp_path: Path) -> None:
    """One process and two spawned processes train; MPI is never initialised."""
    site = _fake_mpi4py(tmp_path / "site")
    completed = _run(
        f"""
        import sys
        from flair_fabric import FabricTrainer
        from tests.support import small_trec, tiny_text_classifier

        corpus = small_trec()
        for devices, strategy in ((1, "auto"), (2, "ddp_spawn")):
            model = tiny_text_classifier(corpus)
            FabricTrainer(model, corpus).train(
                r"{tmp_path}/run-" + str(devices), max_epochs=1, mini_batch_size=8, accelerator="cpu",
                devices=devices, strategy=strategy, precision="bf16-mixed",
            )
        assert "mpi4py.MPI" not in sys.modules
        print("TRAINED")
        """,
        site,
    )
    assert "MPI_INIT failed" not in completed.stderr, "MPI was initialised without an MPI launcher"
    expect_success(completed.returncode, "the training", completed.stdout + completed.stderr)
    assert "TRAINED" in completed.stdout


# what Open MPI, MPICH/Hydra and Intel MPI, PMIx launchers, MVAPICH and MPICH's mpiexec set (docs/gpu-check.md)
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def test_an_mpi_launched_process_still_gets_lightnings_mpi_environment(tmp_path: Path) -> None:
    """Started by an MPI launcher (any one of its variables set, MPI working): the choice is Fabric's own,
    MPIEnvironment; with none of them set, Lightning's own environment, and MPI is not asked."""
    site = _fake_mpi4py(tmp_path / "site")
    code = f"""
        import os
        from flair_fabric.launch.environment import cluster_environment
        print("plain", type(cluster_environment()).__name__)  # MPI initialised here would end the process
        os.environ["FAKE_MPI_SIZE"] = "2"  # MPI now starts
        for name in {LAUNCHER_VARIABLES!r}:
            os.environ[name] = "2"  # what the launcher sets
            print(name, type(cluster_environment()).__name__)
            del os.environ[name]
        """
    completed = _run(code, site)
    assert "MPI_INIT failed" not in completed.stderr, "MPI was initialised without an MPI launcher"
    expect_success(completed.returncode, "the detection", completed.stderr)
    expected = ["plain LightningEnvironment", *(f"{name} MPIEnvironment" for name in LAUNCHER_VARIABLES)]
    assert completed.stdout.splitlines()[-6:] == expected
