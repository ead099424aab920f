"""FlairDDPStrategy's DDP options, read from the DistributedDataParallel module it really builds (one process, gloo,
world size 1: DDP wraps, probes, buckets and all-reduces there as on N ranks): its defaults against PyTorch's, the
caller's options, the probe for unused parameters, PowerSGD's defaults and one all-reduce per optimizer step."""

# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from flair.data import Corpus
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from flair_fabric import FabricTrainer, FlairDDPStrategy

from ..support import small_trec, tiny_text_classifier

MIB = 1024 * 1024


@dataclass
class _Wrapped:
    """What one run's DDP module was built with, and the same attributes of a DDP module built with PyTorch's
    defaults in the same process group (the reference)."""

    find_unused_parameters: bool | None = None
    gradient_as_bucket_view: bool | None = None
    bucket_bytes_cap: int | None = None
    static_graph: bool | None = None
    pytorch_default: dict[str, Any] = field(default_factory=dict)
    all_reduces: Counter = field(default_factory=Counter)
    """(optimizer step, bucket index) -> gradient all-reduces of that bucket in that step."""
    forward_passes: Counter = field(default_factory=Counter)
    """optimizer step -> forward passes (chunks) of the model."""
    passes_before_all_reduce: dict = field(default_factory=dict)
    """(optimizer step, bucket index) -> forward passes of that step when the bucket was all-reduced."""
    step: int | None = None


def _counting_all_reduce(record: _Wrapped, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own exact all-reduce hook, counting each call by the optimizer step it happens in."""
    record.all_reduces[(record.step, bucket.index())] += 1
    record.passes_before_all_reduce[(record.step, bucket.index())] = record.forward_passes[record.step]
    return default_hooks.allreduce_hook(None, bucket)


class _RecordingDDPStrategy(FlairDDPStrategy):
    """FlairDDPStrategy that records the DDP module it builds (and, if asked, counts its gradient all-reduces)."""

    def __init__(self, record: _Wrapped, count_all_reduces: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record, self.count_all_reduces = record, count_all_reduces

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        wrapped = super().setup_module(module)
        record = self.record
        record.find_unused_parameters = wrapped.find_unused_parameters
        record.gradient_as_bucket_view = wrapped.gradient_as_bucket_view
        record.bucket_bytes_cap = wrapped.bucket_bytes_cap
        record.static_graph = wrapped.static_graph
        reference = DistributedDataParallel(torch.nn.Linear(2, 2))
        record.pytorch_default = {
            "gradient_as_bucket_view": reference.gradient_as_bucket_view,
            "bucket_bytes_cap": reference.bucket_bytes_cap,
            "static_graph": reference.static_graph,
        }
        if self.count_all_reduces:
            wrapped.register_comm_hook(record, _counting_all_reduce)
        return wrapped


class _StepCounter(TrainerPlugin):
    """Tells the record which optimizer step runs, and counts the model's forward passes (chunks) per step."""

    def __init__(self, record: _Wrapped) -> None:
        super().__init__()
        self.record = record

    def attach_to(self, pluggable: Any) -> None:
        super().attach_to(pluggable)
        pluggable.model.decoder.register_forward_pre_hook(self._forward_pass)

    def _forward_pass(self, *args: Any) -> None:
        if self.record.step is not None:
            self.record.forward_passes[self.record.step] += 1

    @TrainerPlugin.hook
    def before_training_batch(self, batch_count: int, **kwargs: Any) -> None:
        self.record.step = batch_count

    @TrainerPlugin.hook
    def after_training_batch(self, **kwargs: Any) -> None:
        self.record.step = None


class _WithAnUnusedParameter(TextClassifier):
    """The tiny classifier with a trainable parameter that no loss ever reaches (like a transformer's pooler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.never_used = torch.nn.Parameter(torch.zeros(3))


class _WithAFrozenParameter(TextClassifier):
    """The tiny classifier with a frozen parameter (requires_grad=False): no gradient, and none expected."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)


@contextlib.contextmanager
def _in_this_process() -> Iterator[None]:
    """A DDP run inside the test process: the process group and the variables Lightning sets (LOCAL_RANK,
    WORLD_SIZE, MASTER_PORT, ...) are gone afterwards, so later tests are not taken for a launched rank; torch's
    thread count is put back."""
    environment, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
        torch.set_num_threads(threads)


def _train(
    folder: Path,
    corpus: Corpus,
    model: TextClassifier,
    record: _Wrapped,
    count_all_reduces: bool = False,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """Two epochs of ``model`` with a recording FlairDDPStrategy on one CPU process; returns the trained weights."""
    strategy = _RecordingDDPStrategy(record, count_all_reduces=count_all_reduces, **options)
    kwargs = {"mini_batch_size": 4, "mini_batch_chunk_size": 2} if count_all_reduces else {"mini_batch_size": 8}
    with _in_this_process():
        FabricTrainer(model, corpus).train(
            folder,
            max_epochs=2,
            learning_rate=0.5,
            shuffle=False,
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            plugins=[_StepCounter(record)],
            save_final_model=False,
            **kwargs,
        )
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _parameters_without_gradient(model: TextClassifier, corpus: Corpus) -> list[str]:
    """The reference: trainable parameters that one forward and backward pass over a train batch leaves without a
    gradient (computed here, on a copy of the model, without flair-fabric)."""
    batch = [corpus.train[index] for index in range(8)]
    for sentence in batch:
        sentence.clear_embeddings()  # embeddings another run left on the shared corpus
    model.zero_grad(set_to_none=True)
    loss, _ = model.forward_loss(batch)
    loss.backward()
    unused = [
        name for name, parameter in model.named_parameters() if parameter.requires_grad and parameter.grad is None
    ]
    model.zero_grad(set_to_none=True)
    for sentence in batch:
        sentence.clear_embeddings()
    return unused


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return small_trec()


def test_ddp_defaults_are_bucket_views_and_pytorchs_bucket_size_and_dynamic_graph(
    corpus: Corpus, tmp_path: Path
) -> None:
    """Without options DDP gets gradient_as_bucket_view=True, and PyTorch's own bucket size (25 MB) and
    static_graph (False)."""
    assert set(FlairDDPStrategy()._ddp_kwargs) <= {"gradient_as_bucket_view", "timeout"}
    record = _Wrapped()
    _train(tmp_path, corpus, tiny_text_classifier(corpus), record)
    assert record.gradient_as_bucket_view is True
    assert record.pytorch_default["bucket_bytes_cap"] == 25 * MIB, "PyTorch's documented default"
    assert record.bucket_bytes_cap == record.pytorch_default["bucket_bytes_cap"]
    assert record.static_graph is record.pytorch_default["static_graph"] is False


def test_ddp_options_given_to_the_strategy_reach_ddp(corpus: Corpus, tmp_path: Path) -> None:
    """FlairDDPStrategy(gradient_as_bucket_view=False, bucket_cap_mb=50, static_graph=True): DDP gets exactly these."""
    record = _Wrapped()
    options = {"gradient_as_bucket_view": False, "bucket_cap_mb": 50, "static_graph": True}
    _train(tmp_path, corpus, tiny_text_classifier(corpus), record, **options)
    assert record.gradient_as_bucket_view is False
    assert record.bucket_bytes_cap == 50 * MIB
    assert record.static_graph is True
    # and one at a time: each overrides only its own default
    strategy = FlairDDPStrategy(gradient_as_bucket_view=False)
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is False


@pytest.mark.parametrize(
    ("model_class", "unused"),
    [(TextClassifier, False), (_WithAnUnusedParameter, True), (_WithAFrozenParameter, False)],
    ids=["every-parameter-learns", "a-parameter-without-gradient", "a-frozen-parameter"],
)
def test_ddp_searches_for_unused_parameters_only_where_the_model_has_one(
    corpus: Corpus, tmp_path: Path, model_class: type[TextClassifier], unused: bool
) -> None:
    """find_unused_parameters="auto" (the default): DDP's graph search is on exactly when some trainable parameter
    gets no gradient (found here by a backward pass of our own); a frozen parameter is not one."""
    without_gradient = _parameters_without_gradient(tiny_text_classifier(corpus, model_class=model_class), corpus)
    assert bool(without_gradient) is unused, without_gradient
    record = _Wrapped()
    try:
        _train(tmp_path, corpus, tiny_text_classifier(corpus, model_class=model_class), record)
    except RuntimeError as error:  # DDP without the search fails in the second step where a parameter is unused
        failure: RuntimeError | None = error
    else:
        failure = None
    assert record.find_unused_parameters is unused, f"parameters without a gradient: {without_gradient}"
    if failure is not None:
        raise failure  # the search was decided right and training failed anyway: a crash, not this claim


@pytest.mark.parametrize(
    ("name", "model_class", "forced"),
    [
        ("ddp_find_unused_parameters_true", TextClassifier, True),
        ("ddp_find_unused_parameters_false", _WithAnUnusedParameter, False),
    ],
    ids=["true-where-every-parameter-learns", "false-where-a-parameter-gets-no-gradient"],
)
def test_a_forced_find_unused_parameters_reaches_ddp(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, model_class: type, forced: bool
) -> None:
    """README: a ddp* strategy name with _find_unused_parameters_true/_false forces DDP's search on or off: the DDP
    module the run builds from the name gets the forced value, where the probe would have decided the other one."""
    record = _Wrapped()
    build = FlairDDPStrategy.setup_module

    def recording(self: FlairDDPStrategy, module: torch.nn.Module) -> DistributedDataParallel:
        wrapped = build(self, module)
        record.find_unused_parameters = wrapped.find_unused_parameters
        return wrapped

    monkeypatch.setattr(FlairDDPStrategy, "setup_module", recording)
    model = tiny_text_classifier(corpus, model_class=model_class)
    options = {"max_epochs": 1, "mini_batch_size": 8, "accelerator": "cpu", "devices": 1, "strategy": name}
    with _in_this_process():
        if forced:
            FabricTrainer(model, corpus).train(tmp_path, **options)
        else:  # DDP without the search fails at the second step, where the unused parameter has no gradient
            with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
                FabricTrainer(model, corpus).train(tmp_path, **options)
    assert record.find_unused_parameters is forced


def test_ddp_all_reduces_each_bucket_once_per_optimizer_step_with_chunks(corpus: Corpus, tmp_path: Path) -> None:
    """mini_batch_chunk_size: a step of several chunks (forward passes) all-reduces each gradient bucket once, after
    its last chunk, not once per chunk."""
    record = _Wrapped()
    _train(tmp_path, corpus, tiny_text_classifier(corpus), record, count_all_reduces=True)
    steps = sorted(record.forward_passes)
    assert len(steps) == 2 * 48 // 4, "every optimizer step of the 2 epochs was seen"
    assert all(record.forward_passes[step] == 2 for step in steps), "batches of 4 in chunks of 2: two passes a step"
    buckets = {bucket for _, bucket in record.all_reduces}
    assert buckets and None not in {step for step, _ in record.all_reduces}, "all-reduces happen inside steps only"
    per_step = {(step, bucket): record.all_reduces[(step, bucket)] for step in steps for bucket in buckets}
    assert set(per_step.values()) == {1}, f"all-reduces per (step, bucket): {per_step}"
    assert set(record.passes_before_all_reduce.values()) == {2}, "the sync comes with the last chunk, not the first"


def _powersgd_states(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every PowerSGDState built from now on (PyTorch's class: whatever builds it)."""
    states: list[Any] = []
    original = powerSGD_hook.PowerSGDState.__init__

    @functools.wraps(original)  # its signature stays PyTorch's
    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        states.append(self)

    monkeypatch.setattr(powerSGD_hook.PowerSGDState, "__init__", recording)
    return states


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            None,
            # the documented defaults: rank 1, from step 10, min_compression_rate 2, error feedback, warm start
            {
                "matrix_approximation_rank": 1,
                "start_powerSGD_iter": 10,
                "min_compression_rate": 2,
                "use_error_feedback": True,
                "warm_start": True,
            },
        ),
        (
            {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3, "warm_start": False},
            {
                "matrix_approximation_rank": 2,
                "start_powerSGD_iter": 3,
                "min_compression_rate": 2,
                "use_error_feedback": True,
                "warm_start": False,
            },
        ),
        (
            {"matrix_approximation_rank": 2},  # one option given: the others keep flair-fabric's defaults
            {
                "matrix_approximation_rank": 2,
                "start_powerSGD_iter": 10,
                "min_compression_rate": 2,
                "use_error_feedback": True,
                "warm_start": True,
            },
        ),
    ],
    ids=["defaults", "options-override", "options-override-one"],
)
def test_ddp_powersgd_runs_with_the_documented_defaults_or_the_given_options(
    corpus: Corpus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, Any] | None,
    expected: dict[str, Any],
) -> None:
    """The PowerSGDState DDP's hook really runs with: flair-fabric's defaults, each overridden by powersgd_options."""
    states = _powersgd_states(monkeypatch)
    _train(
        tmp_path,
        corpus,
        tiny_text_classifier(corpus),
        _Wrapped(),
        gradient_compression="powersgd",
        powersgd_options=options,
    )
    assert len(states) == 1, "one PowerSGD state for the wrapped model"
    used = {name: getattr(states[0], name) for name in expected}
    assert used == expected
    assert states[0].iter > 0, "the hook ran"
