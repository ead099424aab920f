"""flair's optimizer steps all parameters at once where that is bit-equal to stepping them one by one; the caller's
choice of implementation wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from flair.optim import SGDW
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from flair_fabric.training.optimizer_implementation import build_optimizer

from ..support import small_trec, tiny_text_classifier


def _parameters() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.zeros(32))]


OPTIONS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.SGD, {"lr": 5.0}),
]


@pytest.mark.parametrize(("optimizer_class", "options"), OPTIONS)
def test_the_grouped_step_is_bit_equal_to_the_step_one_parameter_at_a_time(
    optimizer_class: Any, options: dict[str, Any]
) -> None:
    """Against PyTorch's for-loop implementation (foreach=False, what flair gets on CPU), 30 steps."""
    grouped, reference = _parameters(), _parameters()
    optimizers = [
        build_optimizer(optimizer_class, grouped, options),
        optimizer_class(reference, foreach=False, **options),
    ]
    assert optimizers[0].param_groups[0]["foreach"] is True
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        gradients = [torch.randn(p.shape, generator=generator) for p in grouped]
        for parameters, optimizer in zip((grouped, reference), optimizers, strict=True):
            for parameter, gradient in zip(parameters, gradients, strict=True):
                parameter.grad = gradient.clone()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(grouped, reference, strict=True))
    assert not torch.equal(reference[0], _parameters()[0])


@pytest.mark.parametrize("choice", [{"fused": True}, {"fused": False}, {"foreach": False}])
def test_the_callers_choice_of_implementation_is_kept(choice: dict[str, bool]) -> None:
    group = build_optimizer(torch.optim.AdamW, _parameters(), {"lr": 0.1, **choice}).param_groups[0]
    assert all(group[key] == value for key, value in choice.items())
    assert not group["foreach"]


def test_other_optimizers_are_built_as_flair_builds_them() -> None:
    class OwnStep(torch.optim.AdamW):  # a subclass may override step
        pass

    assert build_optimizer(OwnStep, _parameters(), {"lr": 0.1}).param_groups[0]["foreach"] is None
    assert "foreach" not in build_optimizer(SGDW, _parameters(), {"lr": 0.1}).param_groups[0]
    # torch's other optimizers take foreach too; they are built as flair builds them (PyTorch's own default)
    for other in (torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam):
        assert build_optimizer(other, _parameters(), {"lr": 0.1}).param_groups[0]["foreach"] is None, other.__name__


class _OptimizerSeen(TrainerPlugin):
    def __init__(self) -> None:
        super().__init__()
        self.foreach: list[Any] = []

    @TrainerPlugin.hook
    def after_setup(self, **kwargs: Any) -> None:
        self.foreach = [group.get("foreach") for group in self.trainer.optimizer.param_groups]


@pytest.mark.parametrize(
    ("method", "options", "groups"),
    [
        ("train", {}, 1),  # SGD
        ("fine_tune", {}, 1),  # AdamW
        ("train", {"optimizer": torch.optim.Adam}, 1),
        ("train", {"decoder_learning_rate": 0.05}, 2),  # flair's two parameter groups
    ],
    ids=["train-sgd", "fine-tune-adamw", "train-adam", "decoder-learning-rate"],
)
def test_fabric_trainer_steps_grouped_by_default(
    tmp_path: Path, method: str, options: dict[str, Any], groups: int
) -> None:
    """docs/ddp-communication.md: FabricTrainer builds Adam, AdamW and SGD with foreach=True unless the caller chose,
    also with flair's separate decoder learning rate (every parameter group)."""
    corpus = small_trec()
    seen = _OptimizerSeen()
    getattr(FabricTrainer(tiny_text_classifier(corpus), corpus), method)(
        tmp_path, max_epochs=1, mini_batch_size=16, accelerator="cpu", devices=1, plugins=[seen], **options
    )
    assert seen.foreach == [True] * groups
