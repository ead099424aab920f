"""On one device FabricTrainer keeps flair's own plugins (docs/limits.md): the plugins attached at set-up are the ones
flair's ModelTrainer attaches, of flair's classes, in flair's order; what flair-fabric adds is its own and stands in
for none of flair's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer

from ..support import small_trec, tiny_text_classifier


class _PluginsAtSetUp(TrainerPlugin):
    """The classes of every plugin attached to the trainer when set-up ends."""

    def __init__(self) -> None:
        super().__init__()
        self.classes: list[type] = []

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        self.classes = [type(plugin) for plugin in self.trainer.plugins]


def _own(cls: type) -> bool:
    return cls.__module__.startswith("flair_fabric.")


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("fine_tune", {"save_model_each_k_epochs": 1, "write_weights": True}),  # flair's linear schedule, checkpoints
        ("train", {"anneal_with_restarts": True}),  # flair's annealing, with restarts
    ],
)
def test_one_device_keeps_flairs_plugins_unchanged(method: str, options: dict[str, Any], tmp_path: Path) -> None:
    seen = {}
    for name, trainer_class, extra in (
        ("flair", ModelTrainer, {}),
        ("fabric", FabricTrainer, {"accelerator": "cpu", "devices": 1}),
    ):
        corpus = small_trec()
        recorder = _PluginsAtSetUp()
        getattr(trainer_class(tiny_text_classifier(corpus), corpus), method)(
            tmp_path / name, max_epochs=1, mini_batch_size=16, plugins=[recorder], **options, **extra
        )
        seen[name] = recorder.classes
    flairs = seen["flair"]
    assert [cls for cls in seen["fabric"] if not _own(cls)] == flairs
    assert not any(_own(cls) for cls in flairs)
    added = [cls for cls in seen["fabric"] if _own(cls)]
    assert not [cls for cls in added if any(issubclass(cls, flair_class) for flair_class in flairs)], added
