"""Nothing in the training step reads a tensor back to the host between the forward pass and the end of backward (a
read-back is a device synchronisation on a GPU, and would stall DDP's overlap of backward and all-reduce).

On CPU there is no device to wait for, so this counts the mechanism instead: every call that turns a tensor into
host values (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``, ``numpy``, ``cpu``, use as an index) made on
any rank between ``before_training_batch`` and ``before_training_optimizer_step`` (the chunks' forward passes,
loss bookkeeping and backward passes, with DDP's hooks). It cannot see a synchronisation that involves no such call
(a blocking host-to-device copy, ``torch.cuda.synchronize``); the GPU check counts those with
``torch.cuda.set_sync_debug_mode``."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier

READ_BACKS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")
_phase: list[str | None] = [None]  # per process: "backward" (forward to end of backward), "rest" (of the step)
_reads: Counter = Counter()  # per process: (phase, method, caller file:line) -> calls


PACKAGE = str(Path(__file__).resolve().parents[2] / "flair_fabric")


def _names_a_device(*args: Any, **kwargs: Any) -> bool:
    """Whether a ``Tensor.to`` call moves the tensor to a device (``to("cpu")``, ``to(device, dtype)``,
    ``to(device=...)``), rather than only casting it (``to(torch.float64)``)."""
    return "device" in kwargs or any(isinstance(arg, (str, torch.device)) for arg in args)


def _counting_moves(original: Callable) -> Callable:
    """``Tensor.to``, counting the calls of flair-fabric's own code that move a tensor to the host: a blocking
    device-to-host copy on a GPU (flair's models move their inputs to ``flair.device`` themselves)."""

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        moved = original(self, *args, **kwargs)
        to_the_host = _names_a_device(*args, **kwargs) and moved.device.type == "cpu"
        if _phase[0] is not None and caller.startswith(PACKAGE) and to_the_host:
            _reads[(_phase[0], "to", f"{caller}:{sys._getframe(1).f_lineno}")] += 1
        return moved

    return counted


def _counting(name: str, original: Callable) -> Callable:
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _phase[0] is not None:
            caller = sys._getframe(1).f_code
            _reads[(_phase[0], name, f"{caller.co_filename}:{sys._getframe(1).f_lineno}")] += 1
        return original(self, *args, **kwargs)

    return counted


class _Phases(TrainerPlugin):
    """Marks the phases of each step on its rank; at the end writes the rank's read-backs to ``folder``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def before_training_batch(self, **kwargs: Any) -> None:
        _phase[0] = "backward"

    @TrainerPlugin.hook
    def before_training_optimizer_step(self, **kwargs: Any) -> None:
        _phase[0] = "rest"

    @TrainerPlugin.hook
    def after_training_batch(self, **kwargs: Any) -> None:
        _phase[0] = None

    @TrainerPlugin.hook
    def after_training(self, **kwargs: Any) -> None:
        rank = self.trainer.global_rank
        rows = [[*key, count] for key, count in _reads.items()]
        (self.folder / f"reads-rank{rank}.json").write_text(json.dumps(rows))


@pytest.mark.multiprocess
def test_step_reads_nothing_back_to_the_host_between_forward_and_the_end_of_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 forked ranks, batches of 2 in chunks of 1 (two forward and backward passes a step, a rank with fewer chunks
    taking part with a stand-in batch), 24 steps an epoch (so steps between log points too): no read-back in any
    step's forward-to-backward part on either rank. The log points' agreements do read back, which shows that the
    counting works in the ranks."""
    for name in READ_BACKS:
        monkeypatch.setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "to", _counting_moves(torch.Tensor.to))
    corpus = small_trec(train_size=96)
    FabricTrainer(tiny_text_classifier(corpus), corpus).train(
        tmp_path,
        max_epochs=1,
        mini_batch_size=2,
        mini_batch_chunk_size=1,
        learning_rate=0.1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        plugins=[_Phases(tmp_path)],
        save_final_model=False,
    )
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"reads-rank{rank}.json").read_text())
        in_backward = [row for row in rows if row[0] == "backward"]
        assert not in_backward, f"rank {rank} read tensors back inside forward/backward: {in_backward}"
        assert any(row[0] == "rest" for row in rows), f"rank {rank}: the counting saw no read-back at all"
