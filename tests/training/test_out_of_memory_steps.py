"""``mini_batch_chunk_size="auto"``: a training step that runs out of device memory is redone in smaller chunks, on
every rank together, and the run ends as the same run chunked from the start ends.

CPU tests cannot run out of device memory, so a model raises ``torch.OutOfMemoryError`` as CUDA does when one pass
holds more than ``most`` data points: in its forward pass, or in its backward pass (a gradient hook on the first
embedding parameter, which runs after the classifier's gradients were computed). Every raise is appended to a file,
so that forked ranks report them too."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
import torch.distributed
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from flair_fabric import FabricTrainer, FlairDDPStrategy, FlairFSDPStrategy
from flair_fabric.evaluation.batches import is_out_of_memory

from ..plugin_support import KillAtStep
from ..support import (
    make_tiny_bert,
    no_training_may_start,
    out_of_step_is_a_hang,
    recording_new_groups,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
    tiny_transformer_classifier,
)

OPTIONS: dict[str, Any] = {
    "max_epochs": 2,
    "learning_rate": 0.1,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "use_final_model_for_eval": False,  # best-model.pt is written too
}


class _FitsFewPoints(TextClassifier):
    """Runs out of memory, as a GPU would, on a training pass of more than ``most`` data points on ``ranks``."""

    most = 2
    ranks: tuple[int, ...] = (0,)
    in_backward = False
    kind = "cuda"  # the error a pass that does not fit raises: CUDA's, or the CPU allocator's RuntimeError
    raises: Path | None = None  # one line per raise
    passes: Path | None = None  # one line per training pass: the rank and its number of data points
    _too_many = False
    _size = 0

    def forward_loss(self, data_points: list) -> tuple[torch.Tensor, int]:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.passes is not None and self.training:
            with self.passes.open("a") as file:
                file.write(f"{rank} {len(data_points)}\n")
        self._too_many = len(data_points) > self.most and rank in self.ranks
        self._size = len(data_points)
        if self._too_many and not self.in_backward:
            self._raise(len(data_points), rank)
        return super().forward_loss(data_points)

    def _raise(self, size: int, rank: int) -> None:
        if self.raises is not None:
            with self.raises.open("a") as file:
                file.write(f"{rank} {size}\n")
        injected = f"(injected: {size} > {self.most} data points)"
        if self.kind == "cpu":
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes {injected}")
        raise torch.OutOfMemoryError(f"CUDA out of memory {injected}")

    def _in_backward(self, gradient: torch.Tensor) -> torch.Tensor:
        if self._too_many and self.in_backward:
            self._too_many = False
            self._raise(self._size, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        return gradient


def _limited(
    model: TextClassifier, folder: Path, most: int, ranks: tuple[int, ...], in_backward: bool, kind: str = "cuda"
) -> Path:
    """Make ``model`` run out of memory (``kind``: CUDA's error or the CPU allocator's) above ``most`` data points per
    pass; the file its raises are written to."""
    model.__class__ = _FitsFewPoints
    raises = folder / "out-of-memory-raises.txt"
    folder.mkdir(parents=True, exist_ok=True)
    _FitsFewPoints.most, _FitsFewPoints.ranks, _FitsFewPoints.in_backward = most, ranks, in_backward
    _FitsFewPoints.kind = kind
    _FitsFewPoints.raises, _FitsFewPoints.passes = raises, None
    first_embedding_parameter = next(model.embeddings.parameters())
    first_embedding_parameter.register_hook(model._in_backward)  # type: ignore[attr-defined]
    return raises


@contextlib.contextmanager
def _retried_together() -> Iterator[None]:
    """An injected out-of-memory error that reaches the caller (the step was not redone) fails the test; ranks that
    fell out of step (one waited for the others until the collective timeout, or their collectives met out of order)
    are a hang."""
    try:
        with out_of_step_is_a_hang():
            yield
    except Exception as error:
        if "out of memory (injected" in str(error) and "one data point alone" not in str(error):
            pytest.fail(f"a step that ran out of memory was not redone in chunks: {error}")
        raise


def _recording_agreements(monkeypatch: pytest.MonkeyPatch, record: Path) -> None:
    """Every all-reduce on a process group other than the default one (the out-of-memory agreement's gloo group)
    first appends the global rank to ``record`` (in forked ranks too)."""
    all_reduce = torch.distributed.all_reduce

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is not None and group is not torch.distributed.group.WORLD:
            with record.open("a") as stream:
                stream.write(f"{torch.distributed.get_rank()}\n")
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", recorded)


def _rows(folder: Path) -> list[dict[str, str]]:
    """loss.tsv as dicts by column title, without the timestamps."""
    lines = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    return [{t: v for t, v in zip(lines[0], row, strict=True) if t != "TIMESTAMP"} for row in lines[1:]]


def _retries(folder: Path) -> list[tuple[int, list[int], int]]:
    """Each retried step global rank 0 logged: its epoch, the ranks that ran out of memory, the new chunk size."""
    pattern = r"epoch (\d+), step \d+: out of memory on rank\(s\) \[([0-9, ]+)\]; the step is redone in chunks of (\d+)"
    return [(int(e), [int(r) for r in ranks.split(", ")], int(c)) for e, ranks, c in re.findall(pattern, _log(folder))]


def _retry_lines(folder: Path) -> list[str]:
    return re.findall(r"out of memory on rank\(s\) \[[0-9, ]+\]; the step is redone in chunks of \d+", _log(folder))


def _log(folder: Path) -> str:
    return (folder / "training.log").read_text()


def test_out_of_memory_errors_of_cuda_mps_and_the_cpu_allocator_are_told_from_other_errors() -> None:
    """The errors a step is redone on: CUDA's ``torch.OutOfMemoryError``, MPS's and the CPU allocator's out-of-memory
    ``RuntimeError`` (their messages as PyTorch raises them); not other runtime errors."""
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 0)"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


@pytest.mark.parametrize(
    ("in_backward", "kind"),
    [(False, "cuda"), (True, "cuda"), (False, "cpu")],
    ids=["forward", "backward", "forward-cpu-allocator"],
)
def test_one_process_retried_steps_end_bit_equal_to_flairs_run_chunked_from_the_start(
    tmp_path: Path, in_backward: bool, kind: str
) -> None:
    """Batches of 8, at most 2 data points per pass: the first step of each epoch runs out of memory at 8 and at 4
    points (CUDA's error, or the CPU allocator's) and is redone in chunks of 2, which hold for the rest of the epoch.
    flair's own trainer with ``mini_batch_chunk_size=2`` from the start is the reference: weights, loss.tsv and model
    files bit-equal."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.3)  # dropout: a retry must draw the masks the first try drew
    reference = copy.deepcopy(model)
    raises = _limited(model, tmp_path / "auto", most=2, ranks=(0,), in_backward=in_backward, kind=kind)
    flair.set_seed(1)  # each run starts from the same generators (flair's loader draws the order from them)
    with _retried_together():
        FabricTrainer(model, corpus).train(
            tmp_path / "auto", mini_batch_size=8, mini_batch_chunk_size="auto", accelerator="cpu", devices=1, **OPTIONS
        )
    flair.set_seed(1)
    ModelTrainer(reference, corpus).train(tmp_path / "flair", mini_batch_size=8, mini_batch_chunk_size=2, **OPTIONS)

    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in model.state_dict().items())
    assert _rows(tmp_path / "auto") == _rows(tmp_path / "flair")
    for name in ("best-model.pt", "final-model.pt"):
        ours, flairs = TextClassifier.load(tmp_path / "auto" / name), TextClassifier.load(tmp_path / "flair" / name)
        assert all(torch.equal(value, flairs.state_dict()[key]) for key, value in ours.state_dict().items()), name
    # remembered for the rest of the epoch: two failed tries in each epoch's first step, none after
    assert len(raises.read_text().splitlines()) == 2 * OPTIONS["max_epochs"]
    assert (
        _retry_lines(tmp_path / "auto")
        == [
            "out of memory on rank(s) [0]; the step is redone in chunks of 4",
            "out of memory on rank(s) [0]; the step is redone in chunks of 2",
        ]
        * OPTIONS["max_epochs"]
    )


class _ErrorOfEveryRank(TrainerPlugin):
    """On every rank: the error the run ends with, written to ``error-rank<r>.txt``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def _training_exception(self, **kw: Any) -> None:
        (self.folder / f"error-rank{self.trainer.global_rank}.txt").write_text(str(sys.exc_info()[1]))


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_a_data_point_that_does_not_fit_alone_ends_the_run_on_every_rank_with_its_name(
    tmp_path: Path, devices: int
) -> None:
    """Every rank stops with the error that names the epoch, the step and the failing rank; the failing rank's error
    also names the data point."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    failing = devices - 1
    _limited(model, tmp_path, most=0, ranks=(failing,), in_backward=False)
    expected = rf"epoch 1, step 1: one data point alone runs out of memory on rank\(s\) \[{failing}\]"
    # (a forked rank's error reaches the caller inside torch's ProcessRaisedException: either rank's)
    with _retried_together(), pytest.raises(RuntimeError if devices == 1 else ProcessRaisedException, match=expected):
        FabricTrainer(model, corpus).train(
            tmp_path,
            mini_batch_size=4,
            mini_batch_chunk_size="auto",
            accelerator="cpu",
            devices=devices,
            strategy="ddp_fork" if devices > 1 else "auto",
            collective_timeout=20,
            plugins=[_ErrorOfEveryRank(tmp_path)],
            **OPTIONS,
        )
    errors = [(tmp_path / f"error-rank{rank}.txt").read_text() for rank in range(devices)]
    assert all(re.match(expected, error) for error in errors), errors
    assert re.match(expected + r" \('.+'\)", errors[failing]), "the failing rank names the data point"


# --- several processes ----------------------------------------------------------------------------------------------

# 2 x 4 = one process's 8, in order (every rank's batch of a step is part of one process's batch)
UNION: dict[str, Any] = {**OPTIONS, "shuffle": False}


def _auto_on_two_ranks(model: TextClassifier, corpus: Any, folder: Path, **options: Any) -> None:
    """``train`` with ``mini_batch_chunk_size="auto"`` on 2 forked CPU ranks, batches of 4 per rank."""
    with _retried_together():
        FabricTrainer(model, corpus).train(
            folder,
            mini_batch_size=4,
            mini_batch_chunk_size="auto",
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
            collective_timeout=20,
            **options,
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("ranks", "in_backward", "balance_batches"),
    [((1,), False, True), ((1,), True, False), ((0, 1), True, True)],
    ids=["rank-1-forward", "rank-1-backward-strided", "both-backward"],
)
def test_two_ranks_retry_together_and_end_like_one_process_on_the_union(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...], in_backward: bool, balance_batches: bool
) -> None:
    """A pass of more than one data point runs out of memory on the given ranks: every rank redoes the step in
    chunks of 2, then of 1 (no rank waits in a collective, no rank steps alone or with a partial gradient), and the
    run ends with the weights and loss.tsv of flair's own trainer on one process and the union of the batches. The
    ranks agree once per attempt of a step (one all-reduce on a gloo group of their own, bounded by the run's
    collective timeout)."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.0)
    reference = copy.deepcopy(model)
    raises = _limited(model, tmp_path / "two", most=1, ranks=ranks, in_backward=in_backward)
    recording_new_groups(monkeypatch, tmp_path / "groups.txt")
    _recording_agreements(monkeypatch, tmp_path / "agreements.txt")
    flair.set_seed(1)
    every_rank = logging.FileHandler(tmp_path / "every-rank.log")  # forked ranks inherit it: what any rank logs
    logging.getLogger("flair").addHandler(every_rank)
    try:
        _auto_on_two_ranks(model, corpus, tmp_path / "two", balance_batches=balance_batches, **UNION)
    finally:
        logging.getLogger("flair").removeHandler(every_rank)
        every_rank.close()
    flair.set_seed(1)
    ModelTrainer(reference, corpus).train(tmp_path / "one", mini_batch_size=8, **UNION)

    assert state_dict_difference(model.state_dict(), reference.state_dict()) < 1e-5
    for ours, union in zip(_rows(tmp_path / "two"), _rows(tmp_path / "one"), strict=True):
        assert ours.keys() == union.keys()
        for title in ours:
            assert float(ours[title]) == pytest.approx(float(union[title]), abs=2e-4), title
    raised = [tuple(map(int, line.split())) for line in raises.read_text().splitlines()]
    assert sorted({rank for rank, _ in raised}) == list(ranks)
    retries = _retries(tmp_path / "two")
    if len(ranks) == 1:  # each raise is one retried attempt, in chunks of half the pass that failed
        assert [size for _, _, size in retries] == [math.ceil(size / 2) for _, size in raised]
    for epoch in range(1, OPTIONS["max_epochs"] + 1):  # halved from the failing pass down to 1, kept for the epoch
        sizes = [size for e, _, size in retries if e == epoch]
        assert sizes and sizes == sorted(set(sizes), reverse=True) and sizes[-1] == 1, (epoch, sizes)
    assert all(set(told_ranks) <= set(ranks) for _, told_ranks, _ in retries)
    told = (tmp_path / "every-rank.log").read_text().count("the step is redone in chunks of")
    assert told == len(retries), "each retried step is logged once, by global rank 0"
    groups = (tmp_path / "groups.txt").read_text().splitlines()
    assert sorted(line for line in groups if line.endswith(" gloo 20.0")) == ["0 gloo 20.0", "1 gloo 20.0"], groups
    attempts = UNION["max_epochs"] * len(corpus.train) // 8 + len(retries)  # every step once, and every retry
    agreements = (tmp_path / "agreements.txt").read_text().split()
    assert [agreements.count(str(rank)) for rank in (0, 1)] == [attempts, attempts], "one agreement per attempt"


@pytest.mark.multiprocess
def test_without_out_of_memory_every_rank_learns_its_whole_batch_in_one_pass(tmp_path: Path) -> None:
    """Batches balanced by length hold more or fewer data points than mini_batch_size; as long as no step runs out of
    memory, each rank's batch is one pass (as with mini_batch_chunk_size=None), not cut at mini_batch_size."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    _limited(model, tmp_path, most=len(corpus.train), ranks=(0, 1), in_backward=False)
    _FitsFewPoints.passes = tmp_path / "passes.txt"
    _auto_on_two_ranks(model, corpus, tmp_path, balance_batches=True, **OPTIONS)
    passes = [tuple(map(int, line.split())) for line in _FitsFewPoints.passes.read_text().splitlines()]
    steps = OPTIONS["max_epochs"] * len(corpus.train) // 8  # batches of 4 on 2 ranks
    for rank in (0, 1):
        assert len([size for r, size in passes if r == rank]) == steps, f"rank {rank} cut a batch into chunks"
    assert max(size for _, size in passes) > 4, "the test needs a rank's batch larger than mini_batch_size"
    assert sum(size for _, size in passes) == OPTIONS["max_epochs"] * len(corpus.train)


def _run(folder: Path, kill_at: int | None = None, **options: Any) -> tuple[TextClassifier, Path]:
    corpus = small_trec()
    model = tiny_text_classifier(corpus, dropout=0.3)
    raises = _limited(model, folder, most=1, ranks=(1,), in_backward=False)
    _auto_on_two_ranks(model, corpus, folder, plugins=[KillAtStep(kill_at)], **{**OPTIONS, "max_epochs": 1}, **options)
    return model, raises


class _GradientHooksLeft(TrainerPlugin):
    """On every rank, once training is over: how many of the model's parameters still carry a hook that runs when
    their gradient was accumulated (written to ``hooks-<rank>.txt``)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        hooked = [p for p in self.trainer.model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
        (self.folder / f"hooks-{torch.distributed.get_rank()}.txt").write_text(str(len(hooked)))


@pytest.mark.multiprocess
def test_two_ranks_retry_a_transformer_whose_forward_pass_broadcasts_buffers(tmp_path: Path) -> None:
    """A transformer has buffers, which DDP broadcasts at the start of a forward pass that follows a synchronised one;
    rank 1 runs out of memory after that start, rank 0 does not: the retry must not leave one rank in a broadcast.
    The run ends with flair's weights on one process and the union of the batches (BERT's pooler, which no pass
    reaches, unchanged by AdamW's weight decay as in flair). When the run is over, no rank's parameters keep the
    gradient sum's hooks (which would keep its buffers, a model's worth of gradients, alive)."""
    corpus = small_trec(train_size=16)
    bert = make_tiny_bert(tmp_path / "bert", corpus)
    model, reference = tiny_transformer_classifier(corpus, bert), tiny_transformer_classifier(corpus, bert)
    assert list(model.buffers()), "the test needs a model with buffers"
    _limited(model, tmp_path / "two", most=2, ranks=(1,), in_backward=False)
    # AdamW decays every parameter that has a gradient: the pooler, which no pass reaches, must keep none
    options = {**UNION, "max_epochs": 1, "learning_rate": 1e-3, "optimizer": torch.optim.AdamW, "weight_decay": 1.0}
    flair.set_seed(1)
    _auto_on_two_ranks(model, corpus, tmp_path / "two", plugins=[_GradientHooksLeft(tmp_path)], **options)
    flair.set_seed(1)
    ModelTrainer(reference, corpus).train(tmp_path / "one", mini_batch_size=8, **options)
    assert state_dict_difference(model.state_dict(), reference.state_dict()) < 1e-5
    sizes = [size for _, ranks, size in _retries(tmp_path / "two") if ranks == [1]]
    assert sizes == sorted(set(sizes), reverse=True) and sizes[-1] == 2, sizes
    assert [(tmp_path / f"hooks-{rank}.txt").read_text() for rank in (0, 1)] == ["0", "0"]


@pytest.mark.multiprocess
def test_a_run_killed_after_a_retried_step_resumes_with_its_chunk_size_to_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    """Killed at step 4 with a checkpoint every 2 steps: the step-2 checkpoint holds the chunk size the first step
    needed, so the resumed run goes on in chunks of 1 without running out of memory again."""
    reference, _ = _run(tmp_path / "uninterrupted")
    folder = tmp_path / "killed"
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        _run(folder, kill_at=4, checkpoint_every_n_steps=2)
    raises = folder / "out-of-memory-raises.txt"
    retried = len(raises.read_text().splitlines())
    assert retried >= 2  # step 1: the whole batch, then halves, down to chunks of 1
    resumed, _ = _run(folder, resume_from="auto", checkpoint_every_n_steps=2)
    assert len(raises.read_text().splitlines()) == retried  # none after the resume
    assert state_dict_difference(resumed.state_dict(), reference.state_dict()) <= 1e-6
    assert _rows(folder) == _rows(tmp_path / "uninterrupted")


STALLED = timedelta(seconds=20)  # a run that was not refused and left a rank waiting ends soon

# --- refused before launch ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mini_batch_chunk_size": "half"}, r"mini_batch_chunk_size='half' is not valid: .*'auto'"),
        ({"mini_batch_chunk_size": 0}, r"mini_batch_chunk_size=0 is not valid: pass a positive number"),
        ({"mini_batch_chunk_size": -1}, r"mini_batch_chunk_size=-1 is not valid: pass a positive number"),
        ({"mini_batch_chunk_size": 2.5}, r"mini_batch_chunk_size=2.5 is not valid: pass a positive number"),
        ({"mini_batch_chunk_size": True}, r"mini_batch_chunk_size=True is not valid: pass a positive number"),
        ({"mini_batch_chunk_size": "AUTO"}, r"mini_batch_chunk_size='AUTO' is not valid: .*'auto'"),
        (
            {"mini_batch_chunk_size": "auto", "strategy": FlairFSDPStrategy(start_method="fork", timeout=STALLED)},
            r"mini_batch_chunk_size='auto' cannot be combined with strategy='fsdp'.*fixed mini_batch_chunk_size",
        ),
        (
            {
                "mini_batch_chunk_size": "auto",
                "strategy": FlairDDPStrategy(start_method="fork", gradient_compression="fp16", timeout=STALLED),
            },
            r"mini_batch_chunk_size='auto' sums the ranks' gradients itself.*gradient_compression",
        ),
    ],
    ids=["a-word", "zero", "negative", "a-float", "a-bool", "auto-in-capitals", "fsdp", "compression"],
)
def test_what_cannot_chunk_on_out_of_memory_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], message: str
) -> None:
    corpus = small_trec()
    no_training_may_start(monkeypatch)  # not refused: the test fails as the run starts, not later in it
    with pytest.raises(ValueError) as refused:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(
            tmp_path, accelerator="cpu", devices=2, max_epochs=1, **options
        )
    assert re.search(message, str(refused.value)), str(refused.value)
    assert not (tmp_path / "loss.tsv").exists()
