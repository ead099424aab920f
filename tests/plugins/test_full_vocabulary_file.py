"""``reduce_transformer_vocab=True`` on several processes: after training the model file is rewritten with the full
vocabulary once, best-model.pt where there is one, else final-model.pt (flair's choice). The 2-rank run with a tiny
BERT (tests/plugins/test_plugins.py) checks what the file holds; this checks which file is written, and how often."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flair_fabric.plugins.flair_fixes import EveryRankReduceTransformerVocabPlugin


class _Trainer:
    """What the plugin's end-of-training hook uses of FabricTrainer: global rank 0 of a job, and ``save_model``."""

    def __init__(self) -> None:
        self.fabric = SimpleNamespace(is_global_zero=True, broadcast=lambda value, src: value)
        self.saved: list[str] = []

    def save_model(self, path: Path, with_optimizer: Any) -> None:
        self.saved.append(Path(path).name)


@pytest.mark.parametrize(
    ("files", "rewritten"),
    [
        (["best-model.pt", "final-model.pt"], ["best-model.pt"]),
        (["final-model.pt"], ["final-model.pt"]),
        ([], []),
    ],
)
def test_the_full_vocabulary_is_written_once_into_best_model_or_else_final_model(
    files: list[str], rewritten: list[str], tmp_path: Path
) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"a model file written during training")
    plugin = EveryRankReduceTransformerVocabPlugin(tmp_path, save_optimizer_state=False)
    trainer = _Trainer()
    plugin._pluggable = trainer  # type: ignore[assignment]  # the hook reads self.trainer
    plugin.save_model_at_the_end()
    assert trainer.saved == rewritten
