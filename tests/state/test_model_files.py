"""Model files are written atomically: a failed save leaves the previous file as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from flair.models import TextClassifier

from flair_fabric.state.model_files import save_model_atomically

from ..support import small_trec, state_dict_difference, tiny_text_classifier


def test_a_save_that_fails_midway_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_text_classifier(small_trec())
    target = tmp_path / "best-model.pt"
    save_model_atomically(model, target)
    before = target.read_bytes()

    original_save = TextClassifier.save

    def save_half_then_crash(self, model_file, checkpoint=False):
        original_save(self, model_file, checkpoint)
        Path(model_file).write_bytes(Path(model_file).read_bytes()[:100])
        raise OSError("disk full")

    monkeypatch.setattr(TextClassifier, "save", save_half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        save_model_atomically(model, target)

    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["best-model.pt"], "the temporary file is removed"
    assert state_dict_difference(TextClassifier.load(target).state_dict(), model.state_dict()) == 0.0
