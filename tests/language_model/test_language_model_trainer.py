"""FabricLanguageModelTrainer against flair's LanguageModelTrainer: one process reproduces it, 2 ranks with b columns
train as one process with 2b, every launcher, Flair embeddings from the result, exact resume after SIGKILL, bad input.
A tiny character LSTM on a few kB of Persuasion: seconds per run."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Sentence
from flair.embeddings import FlairEmbeddings
from flair.models import LanguageModel, SequenceTagger
from flair.trainers import ModelTrainer
from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus

from flair_fabric import FabricLanguageModelTrainer

from ..support import FABRIC_PRECISIONS, run_script, small_wnut, state_dict_difference
from .lm_support import (
    LM_OPTIONS,
    copy_model,
    seeded,
    summaries,
    tiny_corpus,
    tiny_language_model,
    validation_perplexities,
)


def _relative_difference(a: LanguageModel, b: LanguageModel) -> float:
    scale = max(float(tensor.abs().max()) for tensor in a.state_dict().values())
    return state_dict_difference(a.state_dict(), b.state_dict()) / scale


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TextCorpus:
    return tiny_corpus(tmp_path_factory.mktemp("lm-corpus"))


@pytest.fixture(scope="module")
def one_process_4_columns(corpus: TextCorpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[LanguageModel, Path]:
    """The reference for several processes: one process, 4 columns."""
    model, out = tiny_language_model(corpus), tmp_path_factory.mktemp("one")
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(out, mini_batch_size=4, devices=1, accelerator="cpu", **LM_OPTIONS)
    return model, out


def test_one_process_reproduces_flairs_language_model_trainer(corpus: TextCorpus, tmp_path: Path) -> None:
    model = tiny_language_model(corpus, dropout=0.1)  # one process: dropout draws as in flair
    theirs, ours = copy_model(model), copy_model(model)
    options = {**LM_OPTIONS, "mini_batch_size": 4, "num_workers": 2}  # flair's loader workers read the splits
    seeded()
    LanguageModelTrainer(theirs, corpus).train(tmp_path / "flair", **options)
    seeded()
    FabricLanguageModelTrainer(ours, corpus).train(tmp_path / "ours", devices=1, accelerator="cpu", **options)
    assert _relative_difference(theirs, ours) <= 1e-6
    assert summaries(tmp_path / "ours") == summaries(tmp_path / "flair")
    assert len(summaries(tmp_path / "ours")) == 7, "3 splits x 2 epochs and the test line"
    best_theirs = LanguageModel.load_language_model(tmp_path / "flair" / "best-lm.pt")
    best_ours = LanguageModel.load_language_model(tmp_path / "ours" / "best-lm.pt")
    assert _relative_difference(best_theirs, best_ours) <= 1e-6
    assert not ours.training, "flair leaves the model in eval mode"


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_two_processes_with_2_columns_train_as_one_with_4(
    corpus: TextCorpus, one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path, strategy: str
) -> None:
    reference, reference_run = one_process_4_columns
    model = tiny_language_model(corpus)
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(
        tmp_path, mini_batch_size=2, devices=2, strategy=strategy, accelerator="cpu", **LM_OPTIONS
    )
    assert _relative_difference(reference, model) <= 1e-5, "the caller's model holds the trained weights"
    assert summaries(tmp_path) == summaries(reference_run), "validation and test perplexity as in one process"
    log = (tmp_path / "training.log").read_text()
    assert log.count("| end of split   2 /  3 | epoch   1") == 1, "each split logged once"
    best = LanguageModel.load_language_model(tmp_path / "best-lm.pt")
    assert _relative_difference(reference, best) <= 1e-5, "the last split had the best validation loss"


@pytest.mark.multiprocess
def test_the_script_relaunch_ends_with_the_same_weights_on_every_rank(
    one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    reference, reference_run = one_process_4_columns
    run_script("language_model_ddp.py", str(tmp_path))
    weights = [torch.load(tmp_path / f"weights-{rank}.pt") for rank in (0, 1)]
    assert state_dict_difference(weights[0], weights[1]) == 0.0
    assert state_dict_difference(weights[0], reference.state_dict()) <= 1e-5
    assert summaries(tmp_path / "run") == summaries(reference_run)


def test_the_trained_model_serves_as_flair_embeddings_for_a_tagger(
    one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    model, run = one_process_4_columns
    embeddings = FlairEmbeddings(str(run / "best-lm.pt"))
    ner = small_wnut(tmp_path / "wnut")
    tagger = SequenceTagger(
        hidden_size=16,
        embeddings=embeddings,
        tag_dictionary=ner.make_label_dictionary("ner", add_unk=False),
        tag_type="ner",
    )
    sentence = Sentence("Anne Elliot walked to Uppercross .")
    embeddings.embed(sentence)
    from_file = torch.stack([token.get_embedding() for token in sentence])
    trained = FlairEmbeddings(copy_model(model))  # the model object the run trained, not a file
    sentence.clear_embeddings()
    trained.embed(sentence)
    assert torch.equal(from_file, torch.stack([token.get_embedding() for token in sentence])), "best-lm.pt is it"
    assert embeddings.embedding_length == 24
    ModelTrainer(tagger, ner).train(tmp_path / "tagger", max_epochs=2, mini_batch_size=8, learning_rate=0.5)
    header, *rows = [line.split("\t") for line in (tmp_path / "tagger" / "loss.tsv").read_text().splitlines()]
    losses = [float(row[header.index("TRAIN_LOSS")]) for row in rows]
    assert len(losses) == 2 and losses[1] < losses[0], "the tagger learns on top of the trained embeddings"
    reloaded = SequenceTagger.load(tmp_path / "tagger" / "final-model.pt")
    assert isinstance(reloaded.embeddings, FlairEmbeddings)


class _KilledAtValidation(FabricLanguageModelTrainer):
    """Dies (SIGKILL, every rank) during the n-th validation, before that split's state is saved."""

    kill_at = 0

    def evaluate(self, data_source: Any, eval_batch_size: int, sequence_length: int) -> float:
        self.validations = getattr(self, "validations", 0) + 1
        if self.validations == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().evaluate(data_source, eval_batch_size, sequence_length)


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_killed_in_the_middle_of_an_epoch_resumes_to_the_uninterrupted_result(
    corpus: TextCorpus, tmp_path: Path, devices: int
) -> None:
    options = {**LM_OPTIONS, "mini_batch_size": 4 // devices, "checkpoint": True, "accelerator": "cpu"}
    options.update(devices=devices, strategy="ddp_fork")  # one forked worker too: SIGKILL spares the test
    model = tiny_language_model(corpus, dropout=0.2)  # dropout: the generators must be restored as well
    uninterrupted, killed = copy_model(model), copy_model(model)
    seeded()
    FabricLanguageModelTrainer(uninterrupted, corpus).train(tmp_path / "whole", **options)
    _KilledAtValidation.kill_at = 5  # split 2 of epoch 2 (shuffled order); the last state is after split 1
    seeded()
    with pytest.raises(Exception, match=r"SIGKILL|signal 9"):
        _KilledAtValidation(killed, corpus).train(tmp_path / "killed", **options)
    assert len(summaries(tmp_path / "killed")) == 4
    flairs = FabricLanguageModelTrainer.load_checkpoint(tmp_path / "killed" / "checkpoint.pt", corpus)
    assert (type(flairs), flairs.epoch, flairs.split) == (FabricLanguageModelTrainer, 1, 1), "flair's checkpoint.pt"
    seeded(99)  # other generators in the caller: the checkpoint's are used
    FabricLanguageModelTrainer(killed, corpus).train(tmp_path / "killed", resume_from="auto", **options)
    assert _relative_difference(uninterrupted, killed) <= 1e-6
    assert summaries(tmp_path / "killed") == summaries(tmp_path / "whole")


BAD = [
    ({"mini_batch_size": 0}, r"mini_batch_size=0 is not valid"),
    ({"mini_batch_size": 400, "devices": 2}, r"validation split \(valid.txt\) has \d+ characters: with"),
    ({"strategy": "fsdp", "devices": 2}, r"strategy='fsdp': FabricLanguageModelTrainer trains with DDP"),
    ({"resume_from": "/nonexistent/run"}, r"resume_from='/nonexistent/run': no lm-checkpoint.pt there"),
    ({"precision": "bf16-true"}, r"precision='bf16-true' \(bf16-true\) casts the whole model, which flair's Lang"),
    ({"precision": 64}, r"precision=64 \(64-true\) casts the whole model.*pass precision='32-true', 'bf16-mixed'"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD)
def test_bad_input_is_refused_before_any_process_starts(
    corpus: TextCorpus, tmp_path: Path, arguments: dict, message: str
) -> None:
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1, **arguments}
    with pytest.raises(ValueError, match=message):
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(tmp_path / "run", **options)
    assert not (tmp_path / "run" / "loss.txt").exists()


def test_a_corpus_without_split_files_is_refused(corpus: TextCorpus, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    for name in ("valid.txt", "test.txt"):
        (empty / name).write_text("x" * 500 + "\n")
    hollow = TextCorpus(empty, corpus.dictionary)
    with pytest.raises(ValueError, match=r"no training text: put one or more split files into .*train"):
        FabricLanguageModelTrainer(tiny_language_model(corpus), hollow).train(
            tmp_path / "run", mini_batch_size=2, accelerator="cpu", devices=1, **LM_OPTIONS
        )


@pytest.mark.multiprocess
def test_bf16_mixed_trains_on_two_cpu_processes(
    corpus: TextCorpus, one_process_4_columns: tuple[LanguageModel, Path], tmp_path: Path
) -> None:
    """On a CPU without bfloat16 instructions oneDNN cannot build a bfloat16 LSTM; the run still trains, close to
    the float32 reference (bfloat16 keeps 8 bits of mantissa)."""
    reference, _ = one_process_4_columns
    model = tiny_language_model(corpus)
    untrained = copy_model(model)
    seeded()
    FabricLanguageModelTrainer(model, corpus).train(
        tmp_path,
        mini_batch_size=2,
        devices=2,
        strategy="ddp_fork",
        accelerator="cpu",
        precision="bf16-mixed",
        **LM_OPTIONS,
    )
    trained_by = _relative_difference(untrained, reference)
    assert _relative_difference(reference, model) <= 0.1 * trained_by
    validation = validation_perplexities(tmp_path)
    assert validation[-1] < validation[0]


@pytest.mark.multiprocess
def test_bf16_mixed_trains_on_two_processes_of_a_cpu_without_bfloat16_instructions(tmp_path: Path) -> None:
    """oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``) has no bfloat16 LSTM, as on CPUs without AVX512-BF16/AMX,
    whatever this CPU has: the LSTM must run without oneDNN, and training still ends close to float32."""
    run_script("language_model_bf16.py", str(tmp_path), extra_env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["onednn_bf16"] is False
    assert result["bf16_from_float32"] <= 0.1 * result["trained_by"]
    assert result["validation_perplexities"][-1] < result["validation_perplexities"][0]


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS)
def test_every_precision_name_trains_or_is_refused_before_anything_starts(
    corpus: TextCorpus, tmp_path: Path, precision: Any
) -> None:
    """32-true and bf16-mixed (every spelling) train; precisions that convert the whole model, CUDA-only ones on a
    CPU and Transformer Engine's are refused before anything is written, the precision named in the error."""
    model = tiny_language_model(corpus)
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    if str(precision) in ("32", "32-true", "bf16", "bf16-mixed"):
        FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision=precision, **options)
        assert len(summaries(tmp_path / "run")) == 4, "3 splits and the test line"
        assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    else:
        with pytest.raises(ValueError, match=re.escape(f"precision={precision!r}")):
            FabricLanguageModelTrainer(model, corpus).train(tmp_path / "run", precision=precision, **options)
        assert not (tmp_path / "run").exists()


class _FailingSecondSave(LanguageModel):
    """A language model whose second ``save`` writes half a file and fails (a full disk, a killed process)."""

    saves = 0

    def save(self, file: Any, **kwargs: Any) -> None:
        type(self).saves += 1
        if type(self).saves == 2:
            Path(file).write_bytes(b"half a model")
            raise OSError("No space left on device")
        super().save(file, **kwargs)


def test_best_lm_pt_is_replaced_only_by_a_complete_file(corpus: TextCorpus, tmp_path: Path) -> None:
    """best-lm.pt (and the run's other files) are written through a temporary file and a rename: a save that fails
    half-way leaves the previous best-lm.pt loadable and no temporary file behind."""
    model = tiny_language_model(corpus)
    model.__class__ = _FailingSecondSave
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1, "learning_rate": 20.0}
    seeded()
    with pytest.raises(OSError, match="No space left"):
        FabricLanguageModelTrainer(model, corpus).train(tmp_path, **options)
    assert _FailingSecondSave.saves == 2, "the second split was the best so far again"
    try:
        LanguageModel.load_language_model(tmp_path / "best-lm.pt")  # the first split's, whole
    except Exception as error:
        pytest.fail(f"best-lm.pt was left half-written by the failed save: {error!r}")
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []
