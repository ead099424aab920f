"""One strategy="fsdp" training on 2 forked CPU ranks (gloo), checked against what docs/sharded-training.md says:
the logged gradient norm is the whole gradient's, the model files are ordinary flair files with the whole weights,
and the caller's model sits on the meta device while its copy trains and holds the trained weights afterwards."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer, FlairFSDPStrategy

from ..support import small_trec, state_dict_difference, tiny_text_classifier

MODEL_FILES = ["model_epoch_1.pt", "model_epoch_2.pt", "best-model.pt", "final-model.pt"]


class ShardedRunProbe(TrainerPlugin):
    """On every rank: the train/gradient_norm records, the first step's batch, whether the caller's model was on the
    meta device at each step, and the caller's model after training (``probe-rank<r>.json``, ``caller-rank<r>.pt``)."""

    def __init__(self, out: Path, caller_model: TextClassifier) -> None:
        super().__init__()
        self.out, self.caller_model = out, caller_model
        self.gradient_norms: list[float] = []
        self.first_batch: list[str] | None = None
        self.caller_on_meta: list[bool] = []
        self.copy_on_meta: list[bool] = []

    @TrainerPlugin.hook
    def before_training_batch(self, batch: list, **kw: Any) -> None:
        if self.first_batch is None:
            self.first_batch = [sentence.to_original_text() for sentence in batch]

    @TrainerPlugin.hook
    def metric_recorded(self, record: Any) -> None:
        if str(record.name) == "train/gradient_norm":
            self.gradient_norms.append(float(record.value))

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        self.caller_on_meta.append(all(parameter.is_meta for parameter in self.caller_model.parameters()))
        self.copy_on_meta.append(any(parameter.is_meta for parameter in self.trainer.model.parameters()))

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        rank = self.trainer.global_rank
        state = self.caller_model.state_dict()
        record = {
            "gradient_norms": self.gradient_norms,
            "first_batch": self.first_batch,
            "caller_on_meta": self.caller_on_meta,
            "copy_on_meta": self.copy_on_meta,
            "meta_after_training": sorted(name for name, tensor in state.items() if tensor.is_meta),
            "trainer_model_is_caller_model": self.trainer.model is self.caller_model,
        }
        (self.out / f"probe-rank{rank}.json").write_text(json.dumps(record))
        plain = {name: tensor.detach().cpu().clone() for name, tensor in state.items() if not tensor.is_meta}
        torch.save(plain, self.out / f"caller-rank{rank}.pt")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """flair's train (SGD, gradient clipping at 5.0) of a tiny classifier whose Linear layers are shard units, on 2
    forked ranks, with save_model_each_k_epochs=1."""
    out = tmp_path_factory.mktemp("sharded")
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    FabricTrainer(model, corpus).train(
        out,
        max_epochs=2,
        mini_batch_size=4,
        learning_rate=0.5,
        save_model_each_k_epochs=1,
        plugins=[ShardedRunProbe(out, model)],
        accelerator="cpu",
        devices=2,
        strategy=FlairFSDPStrategy(start_method="fork", policy={torch.nn.Linear}),
    )
    return {"out": out, "model": model, "initial": initial}


def _probe(run: dict[str, Any], rank: int) -> dict[str, Any]:
    return json.loads((run["out"] / f"probe-rank{rank}.json").read_text())


def _first_step_gradient_norm(first_batches: list[list[str]]) -> float:
    """In one process, without sharding: the norm of the gradient of the summed loss of the first step's batches
    of both ranks, from the initial weights (the gradient the sharded ranks clip at step 1)."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    by_text = {sentence.to_original_text(): sentence for sentence in corpus.train}
    model.train()
    loss = sum(model.forward_loss([by_text[text] for text in batch])[0] for batch in first_batches)
    loss.backward()
    return math.sqrt(sum(float(parameter.grad.double().pow(2).sum()) for parameter in model.parameters()))


@pytest.mark.multiprocess
def test_the_logged_gradient_norm_is_the_whole_gradients(sharded_run: dict[str, Any]) -> None:
    """Every rank logs the same train/gradient_norm at every step, and at step 1 it is the norm one process computes
    for the whole gradient of both ranks' batches (each rank holds only its shard of it)."""
    rank0, rank1 = _probe(sharded_run, 0), _probe(sharded_run, 1)
    assert len(rank0["gradient_norms"]) == 12, "6 steps per epoch, 2 epochs"
    assert rank0["gradient_norms"] == pytest.approx(rank1["gradient_norms"], rel=1e-6)
    expected = _first_step_gradient_norm([rank0["first_batch"], rank1["first_batch"]])
    assert rank0["gradient_norms"][0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", MODEL_FILES)
def test_fsdp_model_files_hold_the_whole_weights_and_load_in_one_process(
    sharded_run: dict[str, Any], name: str
) -> None:
    """best-model.pt, final-model.pt and model_epoch_k.pt: plain tensors of the whole model's shapes, flair's model
    state, read by TextClassifier.load in this process (no process group)."""
    path = sharded_run["out"] / name
    assert path.is_file(), f"{name} was not written"
    state = torch.load(path, map_location="cpu", weights_only=False)
    weights = state["state_dict"]
    shapes = {key: tuple(tensor.shape) for key, tensor in sharded_run["initial"].items()}
    assert {key: tuple(tensor.shape) for key, tensor in weights.items()} == shapes
    assert all(type(tensor) is torch.Tensor for tensor in weights.values()), {k: type(v) for k, v in weights.items()}
    loaded = TextClassifier.load(path)
    assert type(loaded) is TextClassifier
    assert state_dict_difference(loaded.state_dict(), sharded_run["initial"]) > 1e-4, "trained weights"


@pytest.mark.multiprocess
def test_the_callers_model_sits_on_meta_while_its_copy_trains(sharded_run: dict[str, Any]) -> None:
    for rank in (0, 1):
        probe = _probe(sharded_run, rank)
        assert probe["caller_on_meta"] == [True] * 12, rank
        assert probe["copy_on_meta"] == [False] * 12, rank


@pytest.mark.multiprocess
def test_the_callers_model_holds_the_trained_weights_on_every_rank(sharded_run: dict[str, Any]) -> None:
    """When train returns, the model passed in holds, on every rank, the whole trained weights flair's trainer
    leaves it with (the best model's, read from best-model.pt in this process); the caller of the forked ranks
    gets them too."""
    best = {
        key: tensor
        for key, tensor in torch.load(sharded_run["out"] / "best-model.pt", map_location="cpu", weights_only=False)[
            "state_dict"
        ].items()
    }
    for rank in (0, 1):
        probe = _probe(sharded_run, rank)
        assert probe["meta_after_training"] == [], rank
        assert probe["trainer_model_is_caller_model"], rank
        handed_back = torch.load(sharded_run["out"] / f"caller-rank{rank}.pt")
        assert state_dict_difference(handed_back, best) == 0.0, rank
    assert state_dict_difference(best, sharded_run["initial"]) > 1e-4
    assert state_dict_difference(sharded_run["model"].state_dict(), best) == 0.0


@pytest.mark.multiprocess
def test_fsdp_trains_in_bf16_true_on_cpu(tmp_path: Path) -> None:
    """strategy='fsdp' with precision='bf16-true' on 2 forked CPU ranks: accepted, trained, and the model file holds
    the bfloat16 weights the run trained."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    try:
        FabricTrainer(model, corpus).train(
            tmp_path,
            max_epochs=1,
            mini_batch_size=8,
            learning_rate=0.5,
            precision="bf16-true",
            accelerator="cpu",
            devices=2,
            strategy=FlairFSDPStrategy(start_method="fork"),
        )
    except ValueError as refused:
        if "does not support precision" not in str(refused):
            raise
        pytest.fail(f"strategy='fsdp' refused precision='bf16-true': {refused}")
    weights = torch.load(tmp_path / "final-model.pt", map_location="cpu", weights_only=False)["state_dict"]
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}, "trained in bfloat16"
    assert state_dict_difference(weights, initial) > 1e-3, "trained"


@pytest.mark.multiprocess
def test_fsdp_model_files_written_during_a_run_hold_plain_whole_tensors(tmp_path: Path) -> None:
    """A run that never reads its own model files back (use_final_model_for_eval=True: no best-model.pt to load
    before the test split): model_epoch_1.pt and final-model.pt still hold plain tensors of the whole model's shapes,
    gathered to rank 0 (not the shards, not distributed tensors), equal to the weights the caller gets back."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    FabricTrainer(model, corpus).train(
        tmp_path,
        max_epochs=1,
        mini_batch_size=8,
        learning_rate=0.5,
        save_model_each_k_epochs=1,
        use_final_model_for_eval=True,
        accelerator="cpu",
        devices=2,
        strategy=FlairFSDPStrategy(start_method="fork", policy={torch.nn.Linear}),
    )
    for name in ("model_epoch_1.pt", "final-model.pt"):
        weights = torch.load(tmp_path / name, map_location="cpu", weights_only=False)["state_dict"]
        kinds = {key: type(tensor).__name__ for key, tensor in weights.items() if type(tensor) is not torch.Tensor}
        assert kinds == {}, f"{name} holds {kinds}, not plain tensors"
        assert {key: tuple(tensor.shape) for key, tensor in weights.items()} == shapes, name
        assert state_dict_difference(weights, model.state_dict()) == 0.0, name
