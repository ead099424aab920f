"""A step that the 16-mixed gradient scaler skips is reported to flair's plugins as ``optimizer_was_run=False``, so
flair's scheduler plugin holds its schedule and nothing becomes NaN.

``precision="16-mixed"`` needs CUDA (the GPU check runs it there, ``precision_16_mixed_overflow``). On CPU the run's
precision plugin is swapped, after set-up, for Lightning's 16-mixed MixedPrecision with PyTorch's CPU GradScaler: the
loss is scaled in backward and the optimizer step goes through ``scaler.step``/``scaler.update`` as on a GPU (the
forward pass stays in float32: Fabric keeps its own autocast context). One gradient is set to inf before one step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import LinearSchedulerPlugin, TrainerPlugin
from lightning.fabric.plugins.precision import MixedPrecision

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier

OVERFLOW_STEP = 4


class _ScaledStepsWithOneOverflow(TrainerPlugin):
    """Puts a 16-mixed gradient scaler in place; sets a gradient to inf before step ``OVERFLOW_STEP``; records for
    every step what the plugins were told, whether the optimizer really stepped (its own step count), the loss scale
    and the position of flair's linear schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.scaler = torch.amp.GradScaler("cpu")
        self.reported: dict[int, Any] = {}
        self.stepped: dict[int, bool] = {}
        self.scale: dict[int, tuple[float, float]] = {}
        self.schedule: dict[int, int] = {}  # the linear schedule's position before each step's optimizer step
        self.final_schedule = 0
        self.finite: dict[int, bool] = {}
        self._weights: list[torch.Tensor] = []
        self._steps_before = 0
        self._scale_before = 0.0

    def _schedule_position(self) -> int:
        scheduler = next(plugin for plugin in self.trainer.plugins if isinstance(plugin, LinearSchedulerPlugin))
        return int(scheduler.scheduler.last_epoch)

    def _optimizer_steps(self) -> int:
        """How many steps AdamW (flair's fine_tune optimizer) has taken: it counts them per parameter."""
        counts = [int(state["step"]) for state in self.trainer.optimizer.state.values() if "step" in state]
        return max(counts, default=0)

    @TrainerPlugin.hook
    def after_setup(self, **kwargs: Any) -> None:
        self.trainer.fabric.strategy.precision = MixedPrecision("16-mixed", "cpu", scaler=self.scaler)

    @TrainerPlugin.hook
    def before_training_optimizer_step(self, batch_count: int, **kwargs: Any) -> None:
        if batch_count == OVERFLOW_STEP:
            parameter = next(p for p in self.model.parameters() if p.grad is not None)
            with torch.no_grad():
                parameter.grad.fill_(float("inf"))
        self._weights = [p.detach().clone() for p in self.model.parameters()]
        self._steps_before = self._optimizer_steps()
        self._scale_before = float(self.scaler.get_scale())
        self.schedule[batch_count] = self._schedule_position()

    @TrainerPlugin.hook
    def after_training_batch(self, batch_count: int, optimizer_was_run: Any = None, **kwargs: Any) -> None:
        parameters = list(self.model.parameters())
        self.reported[batch_count] = optimizer_was_run
        self.stepped[batch_count] = self._optimizer_steps() > self._steps_before
        if batch_count == OVERFLOW_STEP:
            self.stepped[batch_count] |= any(
                not torch.equal(before, after.detach()) for before, after in zip(self._weights, parameters, strict=True)
            )
        self.scale[batch_count] = (self._scale_before, float(self.scaler.get_scale()))
        self.finite[batch_count] = all(bool(torch.isfinite(p).all()) for p in parameters)

    @TrainerPlugin.hook
    def after_training_epoch(self, **kwargs: Any) -> None:
        self.final_schedule = self._schedule_position()  # flair's plugins have all seen the last step

    def advance(self, step: int) -> int:
        """How far flair's linear schedule moved because of ``step``."""
        return self.schedule.get(step + 1, self.final_schedule) - self.schedule[step]


def test_step_skipped_by_the_gradient_scaler_is_reported_as_optimizer_not_run(tmp_path: Path) -> None:
    """The step with an inf gradient: the scaler skips it (scale halved, no optimizer step), the plugins get
    optimizer_was_run=False and flair's linear schedule does not advance; every other step is reported as run, and
    the weights stay finite."""
    corpus = small_trec()
    probe = _ScaledStepsWithOneOverflow()
    FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(
        tmp_path,
        max_epochs=1,
        mini_batch_size=4,
        learning_rate=0.01,
        accelerator="cpu",
        devices=1,
        plugins=[probe],
        save_final_model=False,
    )
    steps = sorted(probe.reported)
    assert len(steps) == 12 and OVERFLOW_STEP in steps
    assert [step for step in steps if not probe.stepped[step]] == [OVERFLOW_STEP], "only that step is skipped"
    before, after = probe.scale[OVERFLOW_STEP]
    assert after == before / 2, "the scaler skipped the step with the inf gradient"
    assert not probe.stepped[OVERFLOW_STEP], "the optimizer stepped or the weights changed"
    assert probe.reported[OVERFLOW_STEP] is False, "flair's plugins were told the optimizer ran"
    assert probe.advance(OVERFLOW_STEP) == 0, "the schedule advanced anyway"
    for step in steps:
        assert probe.reported[step] is probe.stepped[step], (step, probe.reported[step])
        assert probe.advance(step) == int(probe.stepped[step]), step
        assert probe.finite[step], f"a weight is not finite after step {step}"
