"""Errors about starting processes, raised before any process starts (no process is started here)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.launch import config as launch_module
from flair_fabric.launch.config import make_launch_config
from flair_fabric.strategies import resolve_strategy

from ..support import small_trec, tiny_text_classifier


def _config(**overrides):
    arguments = {
        "accelerator": "cpu",
        "devices": 2,
        "num_nodes": 1,
        "strategy": "auto",
        "precision": None,
        "use_amp": False,
        **overrides,
    }
    return make_launch_config(**arguments)


def test_fork_after_cuda_was_initialised_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launch_module, "cuda_is_initialized", lambda: True)
    corpus = small_trec()
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    fix = (
        r"cannot fork worker processes: CUDA is already initialised.*Set flair.device = torch.device\('cpu'\)"
        r" \(or FLAIR_DEVICE=cpu\) before building the model.*or use strategy='ddp_spawn' in a script"
    )
    for strategy in ("ddp_fork", "ddp_notebook"):
        with pytest.raises(RuntimeError, match=fix):
            trainer.train(tmp_path, accelerator="cpu", devices=2, strategy=strategy)
        # whatever the accelerator: GPU workers are refused the same way
        with pytest.raises(RuntimeError, match=fix):
            launch_module.check_start_method(_resolved(strategy, "cuda"), None, "cuda")
    assert trainer.fabric is None


def test_forking_gpu_workers_after_the_cuda_driver_was_initialised_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``import flair`` before flair_fabric initialises the CUDA driver (torch.cuda.is_initialized() stays False);
    GPU workers forked afterwards fail (the GPU check saw it). CPU workers are not affected."""
    monkeypatch.setattr(launch_module, "cuda_driver_initialized", lambda: True)
    for strategy in ("ddp_fork", "ddp_notebook"):
        resolved = _resolved(strategy, "cuda")
        with pytest.raises(RuntimeError, match=r"initialised the CUDA driver.*import flair_fabric before flair"):
            launch_module.check_start_method(resolved, None, "cuda")
        launch_module.check_start_method(_resolved(strategy, "cpu"), None, "cpu")
    monkeypatch.setattr(launch_module, "cuda_driver_initialized", lambda: False)
    launch_module.check_start_method(_resolved("ddp_fork", "cuda"), None, "cuda")


def _resolved(strategy: str, accelerator: str) -> Any:
    return resolve_strategy(
        strategy, world_size=2, accelerator=accelerator, launched=False, interactive=False, timeout=timedelta(seconds=9)
    )


def test_importing_flair_fabric_first_keeps_torch_from_initialising_the_cuda_driver() -> None:
    """flair asks torch.cuda.is_available() when imported; importing flair_fabric first sets the NVML-based check
    before that (also when the script imports flair itself right after, and when it uses flair-fabric's names)."""
    code = (  # a spy on torch.cuda.is_available notes the variable at the moment flair asks
        "import os, torch\n"
        "asked = []\n"
        "original = torch.cuda.is_available\n"
        "def spy():\n"
        "    asked.append(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))\n"
        "    return original()\n"
        "torch.cuda.is_available = spy\n"
        "import flair_fabric\n"
        "import flair\n"
        "from flair_fabric import FabricTrainer\n"
        "print(asked[0] if asked else 'never asked')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert completed.stdout.split()[-1] == "1"


TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "test",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"devices": 3, "num_nodes": 2}, r"devices=3, but torchrun started 4 process\(es\), 2 per node.*devices=2"),
        ({"devices": 2}, r"num_nodes=1, but torchrun started 4 process\(es\).*num_nodes='auto'.* or num_nodes=2"),
        ({"devices": 2, "num_nodes": 3}, r"num_nodes=3, but torchrun started 4 process\(es\).* or num_nodes=2"),
        ({"devices": 1, "num_nodes": 2}, r"devices=1, but torchrun started 4 process\(es\), 2 per node.*devices=2"),
        ({"num_nodes": 2, "strategy": "ddp_spawn"}, r"the processes exist already.*use strategy='ddp'"),
    ],
)
def test_torchrun_mismatch_is_an_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch, overrides: dict, message: str
) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        _config(**overrides)
    config = _config(devices="auto", num_nodes=2)
    assert (config.devices, config.world_size) == (2, 4)


def test_num_nodes_auto_follows_torchrun_and_slurm_and_is_one_for_a_plain_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README: num_nodes="auto" (the default) is what torchrun or SLURM started, else 1; what an elastic agent
    sets after a restart on fewer nodes is followed, with nothing in the script to change."""
    assert _config(num_nodes="auto").num_nodes == 1, "a plain script: one machine"
    for world_size, nodes in (("4", 2), ("2", 1), ("6", 3)):  # an elastic agent's restarts: 2 nodes, then 1, then 3
        for name, value in {**TORCHRUN_ENV, "WORLD_SIZE": world_size}.items():
            monkeypatch.setenv(name, value)
        config = _config(devices="auto", num_nodes="auto")
        assert (config.num_nodes, config.world_size) == (nodes, int(world_size))
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name)
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"}
    for name, value in {**slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(name, value)
    config = _config(devices="auto", num_nodes="auto")
    assert (config.num_nodes, config.world_size) == (2, 4)


def test_slurm_mismatch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = {
        "SLURM_NTASKS": "3",
        "SLURM_NTASKS_PER_NODE": "3",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"devices=2, but SLURM started 3 task\(s\) on 1 node\(s\).*devices=3"):
        _config(devices=2)
    with pytest.raises(ValueError, match=r"num_nodes=2, but SLURM started 3 task\(s\) on 1 node\(s\).*num_nodes=1"):
        _config(devices=3, num_nodes=2)
    assert _config(devices="auto").devices == 3


def test_strategy_names_and_auto_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, start_method in (
        ("ddp", "popen"),
        ("ddp_spawn", "spawn"),
        ("ddp_fork", "fork"),
        ("ddp_notebook", "fork"),
    ):
        strategy = _config(strategy=name).strategy
        assert isinstance(strategy, FlairDDPStrategy) and strategy.start_method == start_method
    assert _config(devices=1).strategy == "auto"
    assert _config().strategy.start_method == "popen"  # type: ignore[union-attr]
    # docs/notebooks.md: in a notebook "auto" forks (resolved without the start-method checks, so that a wrong
    # choice shows here as a wrong start method, not as a refusal)
    interactive = resolve_strategy(
        "auto", world_size=2, accelerator="cpu", launched=False, interactive=True, timeout=timedelta(seconds=9)
    )
    assert isinstance(interactive, FlairDDPStrategy) and interactive.start_method == "fork"
    monkeypatch.setattr(launch_module, "is_interactive", lambda: True)
    assert _config().strategy.start_method == "fork"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"relaunches the running script.*use strategy='ddp_notebook'"):
        _config(strategy="ddp")
    with pytest.raises(ValueError, match=r"starts fresh Python processes.*use strategy='ddp_notebook'"):
        _config(strategy="ddp_spawn")


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_auto_accelerator_picks_cuda_then_mps_then_cpu(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, mps: bool, expected: str
) -> None:
    """README: accelerator="auto" (the default) picks CUDA, then MPS, then CPU."""
    monkeypatch.setattr(launch_module.CUDAAccelerator, "is_available", staticmethod(lambda: cuda))
    monkeypatch.setattr(launch_module.MPSAccelerator, "is_available", staticmethod(lambda: mps))
    assert launch_module.resolve_accelerator("auto") == expected
    for method in (FabricTrainer.train, FabricTrainer.fine_tune, FabricTrainer.train_custom):
        assert inspect.signature(method).parameters["accelerator"].default == "auto"


@pytest.mark.parametrize("name", ["ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_find_unused_parameters_suffixes_force_ddps_search_on_or_off(name: str) -> None:
    """README: every ddp* name also takes Lightning's _find_unused_parameters_true/_false suffix, which turns DDP's
    search for parameters without a gradient on/off (instead of deciding it by a probe); the start method stays."""
    for suffix, forced in (("_find_unused_parameters_true", True), ("_find_unused_parameters_false", False)):
        strategy = _config(strategy=name + suffix).strategy
        assert isinstance(strategy, FlairDDPStrategy)
        assert strategy.find_unused_parameters is forced, name + suffix
        assert strategy.start_method == _config(strategy=name).strategy.start_method  # type: ignore[union-attr]
    assert _config(strategy=name).strategy.find_unused_parameters == "auto"  # type: ignore[union-attr]


def _train_inside_a_group_made_elsewhere(rank: int, port: int, base_path: str, answers: Any) -> None:
    """What Ray Train does before a training function runs: a gloo group of 2, made without the variables Fabric
    reads; then the training function calls FabricTrainer as a user would (devices='auto')."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    try:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(f"{base_path}/{rank}", max_epochs=1)
        answers.put((rank, "trained"))
    except ValueError as refused:
        answers.put((rank, str(refused)))
    finally:
        dist.destroy_process_group()


def test_a_run_inside_a_process_group_another_engine_made_is_refused_not_trained_alone(tmp_path: Path) -> None:
    """Never N copies training alone in silence: each process of a group of 2 made elsewhere is refused, naming the
    group's size and what to do, before anything is written."""
    import multiprocessing

    from ..support import free_port

    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_train_inside_a_group_made_elsewhere, args=(r, port, str(tmp_path), answers))
        for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    told = dict(answers.get(timeout=5) for _ in ranks)
    for rank in (0, 1):
        assert "one of 2 in a process group that exists already" in told[rank], told[rank]
        assert "would be 1 process(es)" in told[rank] and "torchrun or SLURM" in told[rank]
    assert not any(tmp_path.iterdir()), "nothing written"
