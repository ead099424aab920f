"""Test-wide settings and the shared two-rank training runs."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before flair and transformers are imported
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("LOCAL_RANK", None)

from .support import ANNEALED, UNION, run_script, write_config


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One user script, five trainings on 2 ranks started by the script relaunch (one process start-up)."""
    out = tmp_path_factory.mktemp("ddp")
    runs = [
        {"name": "union", "method": "train_custom", "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2}},
        {
            "name": "strided",
            "method": "train_custom",
            "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2, "balance_batches": False},
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
        },
        {"name": "annealed", "method": "train", "kwargs": ANNEALED},
    ]
    config = write_config(out / "config.json", {"out": str(out), "runs": runs})
    run_script("ddp_runs.py", str(config))
    return out
