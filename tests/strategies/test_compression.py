"""Gradient compression by choice (``FlairDDPStrategy(gradient_compression=...)``) on two forked CPU ranks: the ranks
stay identical, the result moves a little away from exact DDP (the hook is really used) and bad input is refused."""

from __future__ import annotations

import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.strategies.compression import register_compression

from ..support import RunHung, out_of_step_is_a_hang, small_trec, state_dict_difference, tiny_text_classifier


class _SavesEveryRanksWeights(TrainerPlugin):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @TrainerPlugin.hook
    def after_training(self, **kwargs: Any) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(self.trainer.model.state_dict(), self.folder / f"rank{rank}.pt")


def _larger_classifier(corpus: Any) -> TextClassifier:
    """About 5 MB of parameters: several DDP buckets of 1 MB (DDP's first bucket alone holds up to 1 MiB)."""
    flair.set_seed(7)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=1024)
    document = DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def _train(folder: Path, larger: bool = False, **strategy_options: Any) -> list[dict[str, torch.Tensor]]:
    folder.mkdir()
    corpus = small_trec()
    model = _larger_classifier(corpus) if larger else tiny_text_classifier(corpus)
    FabricTrainer(model, corpus).train(
        folder,
        max_epochs=2,
        mini_batch_size=4,
        learning_rate=0.5,
        shuffle=False,
        accelerator="cpu",
        devices=2,
        # a short timeout: a collective mismatch ends the run instead of hanging it
        strategy=FlairDDPStrategy(start_method="fork", timeout=timedelta(seconds=60), **strategy_options),
        plugins=[_SavesEveryRanksWeights(folder)],
        save_final_model=False,
    )
    return [torch.load(folder / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], float]:
    """Exact DDP's trained weights, and how far training moved them (largest change of a weight)."""
    rank0, rank1 = _train(tmp_path_factory.mktemp("exact") / "run")
    assert state_dict_difference(rank0, rank1) == 0.0
    return rank0, state_dict_difference(tiny_text_classifier(small_trec()).state_dict(), rank0)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("compression", "options", "largest_share"),
    # measured: bf16 1.1%, fp16 0.07%, PowerSGD (rank 1, on a model this small) 53% of training's change
    [("bf16", None, 0.03), ("fp16", None, 0.003), ("powersgd", {"start_powerSGD_iter": 2}, 0.8)],
)
def test_compressed_ranks_stay_identical_and_close_to_exact(
    exact: tuple[dict[str, torch.Tensor], float], tmp_path: Path, compression: str, options: Any, largest_share: float
) -> None:
    exact_weights, moved = exact
    rank0, rank1 = _train(tmp_path / "run", gradient_compression=compression, powersgd_options=options)
    assert state_dict_difference(rank0, rank1) == 0.0, "every rank applies the same (decompressed) gradient"
    share = state_dict_difference(rank0, exact_weights) / moved
    assert 0.0 < share <= largest_share, f"{compression}: {share:.4f} of training's change away from exact DDP"


def _recording_bucket_order(folder: Path) -> Any:
    """PyTorch's ``powerSGD_hook``, writing on each rank when it starts a bucket and when that bucket's collectives
    end ("start <index>" / "end <index>" lines of ``<folder>/buckets-rank<r>.txt``, written as they happen)."""
    original = powerSGD_hook.powerSGD_hook

    def recording(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
        path, index = folder / f"buckets-rank{torch.distributed.get_rank()}.txt", bucket.index()
        with path.open("a") as events:
            events.write(f"start {index}\n")

        def ended(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            with path.open("a") as events:
                events.write(f"end {index}\n")
            return future.value()

        return original(state, bucket).then(ended)

    return recording


@pytest.mark.multiprocess
def test_powersgd_over_several_buckets_keeps_the_ranks_collectives_in_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/ddp-communication.md: PowerSGD runs one bucket after the other, so the ranks' collectives stay in step.
    PowerSGD all-reduces each bucket twice, the second time from a callback: unordered, two buckets' collectives can
    meet in a different order on each rank (gloo: "Received data size doesn't match expected size"). Recorded on each
    rank: a bucket starts only after the bucket started before it has ended, and both ranks run the same sequence."""
    monkeypatch.setattr(powerSGD_hook, "powerSGD_hook", _recording_bucket_order(tmp_path))  # forked ranks inherit it
    options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}
    failure: RunHung | None = None
    try:
        with out_of_step_is_a_hang():
            rank0, rank1 = _train(
                tmp_path / "run",
                larger=True,
                bucket_cap_mb=1,
                gradient_compression="powersgd",
                powersgd_options=options,
            )
    except RunHung as hung:  # the ranks fell out of step: the recorded order says why, then the hang is reported
        failure = hung
    sequences = [(tmp_path / f"buckets-rank{rank}.txt").read_text().split("\n")[:-1] for rank in (0, 1)]
    for rank, sequence in enumerate(sequences):
        assert len({event.split()[1] for event in sequence}) > 1, "several buckets"
        in_flight = [event.split()[0] for event in sequence]
        assert in_flight == ["start", "end"] * (len(sequence) // 2), (
            f"rank {rank}: a bucket started before the last ended"
        )
    assert sequences[0] == sequences[1]
    if failure is not None:
        raise failure
    assert state_dict_difference(rank0, rank1) == 0.0


@pytest.mark.multiprocess
def test_powersgd_with_unused_parameters_is_refused_with_the_reason(tmp_path: Path) -> None:
    # measured: with find_unused_parameters=True the ranks' PowerSGD collectives fall out of step on gloo. The
    # refusal names both arguments, the reason and the fix
    refusal = r"(?s)ValueError: gradient_compression='powersgd' with find_unused_parameters=True.*fall out of step"
    with pytest.raises(ProcessRaisedException, match=refusal + r".*Use 'bf16' or 'fp16', or let every trainable"):
        _train(tmp_path / "run", find_unused_parameters=True, gradient_compression="powersgd")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("compression", "largest_share"), [("bf16", 0.03), ("fp16", 0.003)])
def test_half_precision_compression_works_where_ddp_searches_for_unused_parameters(
    exact: tuple[dict[str, torch.Tensor], float], tmp_path: Path, compression: str, largest_share: float
) -> None:
    """Unlike PowerSGD, bf16 and fp16 are accepted with find_unused_parameters=True and train as without it: the
    ranks stay identical, close to exact DDP."""
    exact_weights, moved = exact
    try:
        rank0, rank1 = _train(tmp_path / "run", find_unused_parameters=True, gradient_compression=compression)
    except ProcessRaisedException as error:  # the refusal that belongs to PowerSGD alone
        if "with find_unused_parameters=True" in str(error):
            pytest.fail(f"gradient_compression={compression!r} with find_unused_parameters=True was refused: {error}")
        raise
    assert state_dict_difference(rank0, rank1) == 0.0
    share = state_dict_difference(rank0, exact_weights) / moved
    assert 0.0 < share <= largest_share, f"{compression}: {share:.4f} of training's change away from exact DDP"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"gradient_compression": "int8"}, r"gradient_compression='int8' is not valid"),
        ({"gradient_compression": "BF16"}, r"gradient_compression='BF16' is not valid: pass None .* or one of 'bf16'"),
        ({"gradient_compression": ""}, r"gradient_compression='' is not valid"),
        ({"gradient_compression": "powerSGD"}, r"gradient_compression='powerSGD' is not valid"),
        ({"powersgd_options": {"matrix_approximation_rank": 2}}, r"powersgd_options is given but"),
        ({"gradient_compression": "powersgd", "powersgd_options": {"rank": 2}}, r"unknown option\(s\) \['rank'\]"),
    ],
)
def test_bad_compression_arguments_are_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlairDDPStrategy(**arguments)


class _Bucket:
    """A DDP gradient bucket as the hook sees it: its flat buffer."""

    def __init__(self, values: list[float]) -> None:
        self.values = torch.tensor(values)

    def buffer(self) -> torch.Tensor:
        return self.values


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_half_precision_sends_each_buckets_average_divided_before_the_cast(
    monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """docs/ddp-communication.md: bf16/fp16 all-reduce each bucket's average, cast to half precision after the
    division by the world size, summed, cast back: a gradient beyond float16's range (81920 > 65504) whose average
    fits arrives whole. On 2 ranks (the all-reduce stands in for a second rank that sends zeros) the bucket ends
    holding its average."""
    sent: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        sent.append(tensor.clone())
        done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        done.set_result([tensor])  # + the other rank's zeros
        return types.SimpleNamespace(get_future=lambda: done)

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    bucket = _Bucket([81920.0, 1.0, -3.0])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    registered: list[Any] = []
    register_compression(  # the hook and its state, as the strategy registers them
        types.SimpleNamespace(register_comm_hook=lambda state, hook: registered.append((state, hook))), compression, {}
    )
    [(state, hook)] = registered
    result = hook(state, bucket).wait()
    assert [tensor.dtype for tensor in sent] == [dtype], "what is all-reduced"
    assert sent[0].tolist() == [40960.0, 0.5, -1.5], "divided by the world size before the cast: it fits"
    assert bucket.values.dtype == torch.float32 and bucket.values.tolist() == [40960.0, 0.5, -1.5], "written back"
    assert result.tolist() == [40960.0, 0.5, -1.5]
