"""The files of a checkpoint are read as data where the run reads them, not only in the check before launch; a sharded
checkpoint's non-tensor items are checked before PyTorch unpickles them (docs/security.md)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as distributed_checkpoint

from flair_fabric import FabricTrainer
from flair_fabric.state import training_state
from flair_fabric.state.safe_loading import UnsafeFile, check_distributed_checkpoint
from flair_fabric.state.training_state import newest_checkpoint, read_progress

from ..support import small_trec, tiny_text_classifier

ONE_DEVICE = {"mini_batch_size": 8, "accelerator": "cpu", "devices": 1, "checkpoint_every_n_epochs": 1}


class _CreatesAFile:
    """Unpickling this object creates ``path``: a stand-in for code an attacker would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_sharded_checkpoints_non_tensor_items_are_checked_before_pytorch_reads_them(tmp_path: Path) -> None:
    """A PyTorch distributed checkpoint whose tensors and first item are plain, with code in a later non-tensor item
    (where a whole-file replacement would not put it): refused naming the file, and the code never runs."""
    marker = tmp_path / "code-ran"
    clean, tampered = tmp_path / "clean", tmp_path / "tampered"
    items = {"a_weight": torch.ones(2), "b_step": "plain text", "c_extra": [1, 2.5, "three"]}
    distributed_checkpoint.save(items, checkpoint_id=clean, no_dist=True)
    check_distributed_checkpoint(clean)  # plain data passes
    distributed_checkpoint.save({**items, "c_extra": _CreatesAFile(marker)}, checkpoint_id=tampered, no_dist=True)
    storage = pickle.loads((tampered / ".metadata").read_bytes()).storage_data
    offsets = {index.fqn: info.offset for index, info in storage.items()}
    assert offsets["c_extra"] > min(offsets.values()), "the item with code is not its file's first"
    assert not marker.exists()
    with pytest.raises(UnsafeFile, match=r"\.distcp does not hold plain data"):
        check_distributed_checkpoint(tampered)
    assert not marker.exists(), "checking the checkpoint ran the code in it"


@pytest.mark.parametrize("name", ["state.ckpt", "extras.pt"])
def test_a_checkpoint_file_is_read_as_data_where_the_run_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The check before launch left out (a file changed after it, or a path that skips it): the run's own reads of
    state.ckpt (model and optimizer) and extras.pt still load data only, and the code in the file never runs."""
    corpus = small_trec()
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path / "run", max_epochs=1, **ONE_DEVICE)
    checkpoint = newest_checkpoint(tmp_path / "run")
    assert checkpoint is not None
    tampered = tmp_path / "tampered"
    shutil.copytree(checkpoint, tampered)
    marker = tmp_path / "code-ran"
    (tampered / name).write_bytes(pickle.dumps({"payload": _CreatesAFile(marker)}))
    monkeypatch.setattr(training_state, "check_checkpoint_folder", read_progress)  # no check before launch
    # state.ckpt is read by torch.load(weights_only=True) itself, extras.pt through the check that names the file
    refused = pickle.UnpicklingError if name == "state.ckpt" else UnsafeFile
    try:
        with pytest.raises(refused, match=r"Weights only load failed"):
            FabricTrainer(tiny_text_classifier(corpus), corpus).train(
                tmp_path / "resumed", max_epochs=2, resume_from=tampered, **ONE_DEVICE
            )
    finally:
        assert not marker.exists(), f"loading {name} ran the code in it"
