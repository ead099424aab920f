"""strategy="fsdp" on two CPU processes (gloo): the same training as DDP, half the memory per rank, and ordinary
flair model files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from lightning.fabric.strategies import DeepSpeedStrategy
from torch.multiprocessing.spawn import ProcessExitedException

from flair_fabric import FabricTrainer, FlairDDPStrategy, FlairFSDPStrategy
from flair_fabric.state.model_state import copy_model
from flair_fabric.strategies import keeps_whole_model
from flair_fabric.strategies.fsdp import ShardedCopy, shard_transformer_layers, transformer_layer_classes

from ..support import (
    make_tiny_bert,
    run_script,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    tiny_transformer_classifier,
    write_config,
)

CORPUS = {"train_size": 48}
# fine_tune: AdamW, linear schedule with warm-up, gradient clipping at flair's default 5.0, the final model
FINE_TUNED = {
    "method": "fine_tune",
    "kwargs": {"max_epochs": 2, "mini_batch_size": 4, "learning_rate": 5e-3, "use_final_model_for_eval": True},
}
# train: SGD, chunked mini-batches, a decoder learning rate (two parameter groups), annealing with restarts from
# best-model.pt, evaluation batches that do not divide the dev split
ANNEALED = {
    "method": "train",
    "kwargs": {
        "max_epochs": 3,
        "mini_batch_size": 4,
        "mini_batch_chunk_size": 2,
        "learning_rate": 0.25,
        "decoder_learning_rate": 0.05,
        "patience": 0,
        "anneal_with_restarts": True,
        "eval_batch_size": 5,
    },
}
LOSS_TOLERANCE = 1e-5  # relative; FSDP reduce-scatters where DDP all-reduces: the sums differ in rounding only
WEIGHT_TOLERANCE = 1e-5  # absolute, every parameter after all epochs (observed: <= 3.6e-7 with SGD, <= 1.2e-7 with
# AdamW outside the parameters below)
ADAMW_NOISE_TOLERANCE = 2e-4  # absolute, under AdamW, for the parameters below (observed: 8.25e-5 and 2.4e-5)
ADAMW_NOISE = ("attention.self.key.bias", "embeddings.word_embeddings.weight")
"""Parameters whose gradient is zero or nearly so, where AdamW divides the rounding noise of the gradient reduction
by its own running RMS and takes steps of about the learning rate from it: the attention key biases (softmax ignores
a constant added to every key of a query, so their exact gradient is zero: what is computed is rounding) and the
embedding entries of rare words (one entry of 10848 above 1e-5: a sum that nearly cancels). Their weights differ from
DDP's by more than rounding; every other parameter stays within WEIGHT_TOLERANCE."""


@pytest.fixture(scope="module")
def fsdp_and_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same two trainings of a tiny-BERT classifier under ddp and fsdp, 2 ranks each, from one script."""
    out = tmp_path_factory.mktemp("fsdp")
    bert_dir = make_tiny_bert(out / "bert", small_trec(**CORPUS))
    runs = [
        {
            "name": f"{setting}-{strategy}",
            "model": "bert",
            "method": config["method"],
            "kwargs": {**config["kwargs"], "devices": 2, "accelerator": "cpu", "strategy": strategy},
        }
        for setting, config in (("fine_tuned", FINE_TUNED), ("annealed", ANNEALED))
        for strategy in ("ddp", "fsdp")
    ]
    config = {"out": str(out), "bert_dir": str(bert_dir), "corpus": CORPUS, "runs": runs}
    run_script("ddp_runs.py", str(write_config(out / "config.json", config)))
    return out


def _summary(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"summary-rank{rank}.json").read_text())


def _handed_back(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    """The weights the caller's model held after train() returned: whole tensors, none left on the meta device."""
    weights = torch.load(run_dir / f"weights-rank{rank}.pt")["final"]
    on_meta = sorted(name for name, tensor in weights.items() if tensor.is_meta)
    assert on_meta == [], f"after train() the caller's model on rank {rank} holds meta tensors: {on_meta}"
    return weights


def _assert_close(expected: list[float], actual: list[float], tolerance: float) -> None:
    assert len(expected) == len(actual) > 0
    for e, a in zip(expected, actual, strict=True):
        assert math.isclose(e, a, rel_tol=tolerance), (expected, actual)


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", ["fine_tuned", "annealed"])
def test_fsdp_trains_like_ddp(fsdp_and_ddp: Path, setting: str) -> None:
    ddp, fsdp = fsdp_and_ddp / f"{setting}-ddp", fsdp_and_ddp / f"{setting}-fsdp"
    ddp_result, fsdp_result = _summary(ddp, 0)["result"], _summary(fsdp, 0)["result"]
    _assert_close(ddp_result["train_loss_history"], fsdp_result["train_loss_history"], LOSS_TOLERANCE)
    _assert_close(ddp_result["dev_loss_history"], fsdp_result["dev_loss_history"], LOSS_TOLERANCE)
    assert ddp_result["dev_score_history"] == fsdp_result["dev_score_history"]
    for rank in (0, 1):  # same learning rates (schedule, annealing) and the same best-model decisions
        assert _summary(fsdp, rank)["lr_trace"] == pytest.approx(_summary(ddp, rank)["lr_trace"], rel=1e-9)
        assert [e["best"] for e in _summary(fsdp, rank)["evaluations"]] == [
            e["best"] for e in _summary(ddp, rank)["evaluations"]
        ]
    # the logged gradient norm is the whole gradient's, as DDP logs it, and clipping (at 5.0) happened
    for rank in (0, 1):
        ddp_norms, fsdp_norms = _summary(ddp, rank)["gradient_norms"], _summary(fsdp, rank)["gradient_norms"]
        assert len(fsdp_norms) == len(_summary(ddp, rank)["lr_trace"]) > 0, "one per step"
        assert fsdp_norms == pytest.approx(ddp_norms, rel=LOSS_TOLERANCE)
        assert max(fsdp_norms) > 5.0
    ddp_weights, fsdp_weights = _handed_back(ddp, 0), _handed_back(fsdp, 0)
    assert ddp_weights.keys() == fsdp_weights.keys()
    for name, weight in ddp_weights.items():
        noise = setting == "fine_tuned" and name.endswith(ADAMW_NOISE)  # fine_tune: AdamW
        difference = (weight - fsdp_weights[name]).abs().max().item()
        assert difference <= (ADAMW_NOISE_TOLERANCE if noise else WEIGHT_TOLERANCE), (name, difference)
    assert state_dict_difference(_handed_back(fsdp, 0), _handed_back(fsdp, 1)) == 0.0, "every rank gets the model"
    if setting == "annealed":
        assert "resetting to best model" in (fsdp / "training.log").read_text(), "annealing must have restarted"


@pytest.mark.multiprocess
def test_fsdp_holds_at_most_six_tenths_of_the_ddp_parameters_and_optimizer_state(fsdp_and_ddp: Path) -> None:
    for rank in (0, 1):  # counted by the script: parameters and optimizer state, a shard by its local size
        ddp = _summary(fsdp_and_ddp / "fine_tuned-ddp", rank)["counted_bytes"]
        fsdp = _summary(fsdp_and_ddp / "fine_tuned-fsdp", rank)["counted_bytes"]
        assert ddp[0] > 0 and all(held <= 0.6 * ddp[0] for held in fsdp), (rank, fsdp, ddp)
    log = (fsdp_and_ddp / "fine_tuned-fsdp" / "training.log").read_text()
    assert "FSDP: 3 shard unit(s) plus the root, over 2 process(es)" in log, "the embeddings and the 2 layers"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("setting", "model_file"), [("fine_tuned", "final-model.pt"), ("annealed", "best-model.pt")])
def test_fsdp_model_files_are_ordinary_flair_files(fsdp_and_ddp: Path, setting: str, model_file: str) -> None:
    run_dir = fsdp_and_ddp / f"{setting}-fsdp"
    loaded = TextClassifier.load(run_dir / model_file)  # one process, no sharding
    assert type(loaded) is TextClassifier
    assert state_dict_difference(loaded.state_dict(), _handed_back(run_dir, 0)) == 0.0
    # the test split, predicted in one process by the loaded file, exactly as the sharded model predicted it
    corpus = small_trec(**CORPUS)
    eval_batch_size = ANNEALED["kwargs"]["eval_batch_size"] if setting == "annealed" else 32
    single = run_dir / "single-process-test.tsv"
    loaded.evaluate(corpus.test, "question_class", out_path=single, mini_batch_size=eval_batch_size)
    assert single.read_bytes() == (run_dir / "test.tsv").read_bytes()


def test_the_default_policy_shards_each_transformer_layer(tmp_path: Path) -> None:
    corpus = small_trec(**CORPUS)
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    assert transformer_layer_classes(model) == {"BertEmbeddings", "BertLayer"}
    policy = shard_transformer_layers(model)
    assert [name for name, module in model.named_modules() if policy(module)] == [
        "embeddings.model.embeddings",
        "embeddings.model.encoder.layer.0",
        "embeddings.model.encoder.layer.1",
    ]


class _BatchesRead(TrainerPlugin):
    """Writes the (text, tokens) of every batch this rank trains on, as it starts the step, to a line of
    ``<folder>/batches-rank<r>.jsonl`` (so a run whose ranks fall out of step still leaves what they read)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def before_training_batch(self, batch: list, **kwargs: Any) -> None:
        with (self.folder / f"batches-rank{self.trainer.global_rank}.jsonl").open("a") as batches:
            batches.write(json.dumps([[sentence.to_original_text(), len(sentence)] for sentence in batch]) + "\n")


def test_only_whole_model_strategies_deal_steps_by_length() -> None:
    """docs/ddp-communication.md: FSDP and DeepSpeed keep strided shards; DDP (and one device) deal by length."""
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # Lightning's constructor needs the deepspeed package
    assert [keeps_whole_model(strategy) for strategy in (FlairFSDPStrategy(), deepspeed)] == [False, False]
    assert [keeps_whole_model(strategy) for strategy in (FlairDDPStrategy(), "auto")] == [True, True]


@pytest.mark.multiprocess
def test_fsdp_with_forked_workers_and_a_user_policy_gives_the_caller_the_trained_model(tmp_path: Path) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    died: ProcessExitedException | None = None
    try:
        FabricTrainer(model, corpus).train(
            tmp_path,
            max_epochs=2,
            mini_batch_size=4,
            shuffle=False,
            accelerator="cpu",
            devices=2,
            strategy=FlairFSDPStrategy(start_method="fork", policy={torch.nn.Linear}),
            plugins=[_BatchesRead(tmp_path)],
        )
    except ProcessExitedException as exited:  # (gloo aborts FSDP ranks whose batches differ): what they read first
        died = exited
    # docs/ddp-communication.md: FSDP keeps strided shards (balance_batches is on by default): rank r reads the
    # epoch's order[r::2] in batches of 4, the same number of points on both ranks
    for rank in (0, 1):
        shard = [[sentence.to_original_text(), len(sentence)] for sentence in list(corpus.train)[rank::2]]
        expected = [shard[start : start + 4] for start in range(0, len(shard), 4)] * 2
        read = [json.loads(line) for line in (tmp_path / f"batches-rank{rank}.jsonl").read_text().splitlines()]
        assert read and read == (expected if died is None else expected[: len(read)]), f"rank {rank}"
    if died is not None:
        raise died
    # the pooling embedding's two maps and the decoder are the three Linear layers
    assert "FSDP: 3 shard unit(s) plus the root, over 2 process(es)" in (tmp_path / "training.log").read_text()
    trained = model.state_dict()
    assert state_dict_difference(initial, trained) > 1e-3
    assert all(not tensor.is_meta for tensor in trained.values())
    assert state_dict_difference(TextClassifier.load(tmp_path / "best-model.pt").state_dict(), trained) == 0.0


@pytest.mark.parametrize("custom_decoder", [False, True])
def test_the_copy_fsdp_shards_is_independent_of_the_callers_model(custom_decoder: bool) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    if custom_decoder:  # flair keeps a custom decoder module itself in the model's state
        decoder = torch.nn.Linear(model.embeddings.embedding_length, len(model.label_dictionary))
        model = TextClassifier(
            model.embeddings, label_type=model.label_type, label_dictionary=model.label_dictionary, decoder=decoder
        )
    copy = copy_model(model)
    assert type(copy) is type(model)
    assert state_dict_difference(copy.state_dict(), model.state_dict()) == 0.0
    copied = {id(parameter) for parameter in copy.parameters()}
    assert not copied & {id(parameter) for parameter in model.parameters()}


def test_the_gathered_model_has_every_parameter_and_buffer_where_the_rank_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model built on the CPU and trained on a GPU (the GPU check's strategy_fsdp_model_built_on_cpu): the caller's
    model that evaluates must hold BERT's non-persistent buffers (token_type_ids, position_ids) on the rank's device
    too, not only the parameters. ``meta`` stands in for the GPU on this CPU-only machine."""
    import flair

    corpus = small_trec(**CORPUS)
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    whole = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    non_persistent = {name for name, _ in model.named_buffers()} - set(whole)
    assert non_persistent, "the tiny BERT should have non-persistent buffers"
    copy = ShardedCopy(model)
    monkeypatch.setattr(flair, "device", torch.device("meta"))
    copy._fill(whole)
    misplaced = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if not tensor.is_meta]
    assert misplaced == []
