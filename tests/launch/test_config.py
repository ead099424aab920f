"""Errors about starting processes, raised before any process starts (no process is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.launch import config as launch_module
from flair_fabric.launch.config import make_launch_config

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
    for strategy in ("ddp_fork", "ddp_notebook"):
        with pytest.raises(RuntimeError, match=r"cannot fork worker processes: CUDA is already initialised"):
            trainer.train(tmp_path, accelerator="cpu", devices=2, strategy=strategy)
    assert trainer.fabric is None


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
        ({"devices": 2}, r"num_nodes=1, but torchrun started 4 process\(es\).*pass num_nodes=2"),
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
    monkeypatch.setattr(launch_module, "is_interactive", lambda: True)
    assert _config().strategy.start_method == "fork"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"relaunches the running script.*use strategy='ddp_notebook'"):
        _config(strategy="ddp")
