"""Throughput: samples/s of flair's ModelTrainer and FabricTrainer(devices=1) (device synchronisations per step
counted on CUDA); and ``flair_fabric.evaluate`` against flair's ``evaluate``."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from common import train_only_corpus

from .context import Context, guarded, result
from .plugins import plugin
from .settings import FAILED, PASSED
from .training import (
    build_classifier,
    fabric_args,
    fine_tune,
    peak_memory,
    recorded_warnings,
    relative_difference,
    synchronize,
    trec,
)

if TYPE_CHECKING:
    from flair.data import Corpus


def timed_epoch(ctx: Context, trainer_name: str, corpus: Corpus, batch: int, extra_plugins: tuple = ()) -> dict:
    """One timed epoch of fine-tuning (no evaluation, nothing saved); seconds of the training part and memory."""
    import flair
    from flair.trainers import ModelTrainer

    from flair_fabric import FabricTrainer

    sizes = ctx.sizes("throughput")
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    timer = plugin("EpochTimer")
    options = {"mini_batch_size": batch, "max_epochs": 1, "shuffle": False, "use_final_model_for_eval": True}
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            fine_tune(ModelTrainer(model, corpus), ctx.work / "flair", sizes, [timer, *extra_plugins], **options)
        else:
            trainer = FabricTrainer(model, corpus)
            fine_tune(trainer, ctx.work / "fabric", sizes, [timer, *extra_plugins], **options, **fabric_args(ctx))
    return {"seconds": timer.seconds[0], **memory}


def count_syncs(ctx: Context, trainer_name: str, corpus: Corpus, batch: int) -> dict:
    """Device synchronisations per training step, from ``torch.cuda.set_sync_debug_mode("warn")``."""
    import torch

    with recorded_warnings() as caught:
        counter = plugin("StepSyncCounter", caught)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed_epoch(ctx, trainer_name, corpus, batch, (counter,))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    steps = counter.per_step
    return {
        "median_per_step": statistics.median(steps) if steps else None,
        "max_per_step": max(steps, default=None),
        "total": sum(steps),
        "steps": len(steps),
        "per_step": steps[:40],
    }


def check_throughput(ctx: Context, batch: int) -> dict:
    """FabricTrainer's epoch time against ModelTrainer's at ``batch`` (ABBA pairs after a warm-up)."""
    name = f"throughput_batch_{batch}"
    sizes = ctx.sizes("throughput")
    corpus = train_only_corpus(sizes.train)
    if not ctx.dry or not ctx.warmed_up:  # first-call costs outside the timed runs (on CPU once per process)
        warm_up = train_only_corpus(min(sizes.train, 4 * batch))
        for trainer_name in ("flair", "fabric"):
            timed_epoch(ctx, trainer_name, warm_up, batch)
        ctx.warmed_up = True
    pairs = 1 if ctx.dry else 3
    seconds: dict[str, list[float]] = {"flair": [], "fabric": []}
    memory: dict[str, float | None] = {}
    for rep in range(pairs):
        for trainer_name in ("fabric", "flair") if rep % 2 == 0 else ("flair", "fabric"):  # ABBA
            run = timed_epoch(ctx, trainer_name, corpus, batch)
            seconds[trainer_name].append(run["seconds"])
            memory[trainer_name] = run["peak_gpu_memory_mib"]
    ratio = statistics.median(fa / fl for fa, fl in zip(seconds["fabric"], seconds["flair"], strict=True))
    samples = {k: round(sizes.train / statistics.median(v), 1) for k, v in seconds.items()}
    syncs = {k: count_syncs(ctx, k, corpus, batch) for k in ("flair", "fabric")} if ctx.cuda else None
    goal = ctx.tolerances.throughput_ratio
    text = (
        f"{sizes.train} questions, batch {batch}: flair {samples['flair']} samples/s, FabricTrainer"
        f" {samples['fabric']} samples/s, time ratio fabric/flair {ratio:.3f} (median of {pairs} ABBA pair(s))"
    )
    if syncs is not None:
        text += (
            f"; syncs per step (median) flair {syncs['flair']['median_per_step']},"
            f" fabric {syncs['fabric']['median_per_step']}"
        )
    if goal is None:
        status, reason = PASSED, text + "; goal (<= 1.02) judged on a GPU only (tiny model, CPU)"
    elif ratio <= goal:
        status, reason = PASSED, text + f" <= {goal}"
    else:
        status, reason = FAILED, f"FabricTrainer takes {100 * (ratio - 1):.1f}% longer (goal <= {goal}): " + text
    return result(
        name,
        status,
        reason,
        train_size=sizes.train,
        batch=batch,
        epoch_seconds=seconds,
        samples_per_second=samples,
        time_ratio_fabric_over_flair=ratio,
        goal_ratio=goal,
        syncs_per_step=syncs,
        sync_counting="torch.cuda.set_sync_debug_mode('warn'), warnings between before_ and after_training_batch"
        if syncs is not None
        else "CUDA only",
        memory={
            f"throughput batch {batch}: flair ModelTrainer": memory.get("flair"),
            f"throughput batch {batch}: FabricTrainer(devices=1)": memory.get("fabric"),
        },
    )


def unit_throughput(ctx: Context) -> Iterator[dict]:
    """Batch 32, then 128."""
    for batch in (32, 128):
        yield guarded(f"throughput_batch_{batch}", functools.partial(check_throughput, ctx, batch))


def check_evaluate(ctx: Context) -> dict:
    """flair_fabric.evaluate on one device (and two processes where possible) against flair's evaluate."""
    import flair

    import flair_fabric
    from flair_fabric.datasets import TREC_LABEL_TYPE

    name = "evaluate_vs_flair"
    sizes = ctx.sizes("evaluate")
    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    model.eval()
    dev: Any = corpus.dev
    sentences = [dev[i] for i in range(len(dev))]

    def flair_evaluate() -> Any:
        return model.evaluate(sentences, gold_label_type=TREC_LABEL_TYPE, mini_batch_size=sizes.batch)

    def fabric_evaluate(devices: int = 1, strategy: str = "auto") -> Any:
        options: dict[str, Any] = {"accelerator": ctx.accelerator, "devices": devices, "strategy": strategy}
        return flair_fabric.evaluate(model, sentences, TREC_LABEL_TYPE, mini_batch_size=sizes.batch, **options)

    timings: dict[str, list[float]] = {"flair": [], "flair_fabric": []}
    scores: dict[str, list[tuple[float, float]]] = {"flair": [], "flair_fabric": []}
    if not ctx.dry:  # warm-up (the dry run times nothing that is judged)
        flair_evaluate()
        fabric_evaluate()
    for rep in range(1 if ctx.dry else 3):
        for label, call in (("flair", flair_evaluate), ("flair_fabric", fabric_evaluate))[:: 1 if rep % 2 else -1]:
            synchronize()
            started = time.perf_counter()
            evaluated = call()
            synchronize()
            timings[label].append(time.perf_counter() - started)
            scores[label].append((float(evaluated.main_score), float(evaluated.loss)))
    reference = scores["flair"][0]
    two = ctx.dry or ctx.gpus >= 2
    if two:
        started = time.perf_counter()
        sharded = fabric_evaluate(devices=2, strategy="ddp_fork" if ctx.dry else "ddp_spawn")
        timings["flair_fabric_2_processes"] = [time.perf_counter() - started]
        scores["flair_fabric_2_processes"] = [(float(sharded.main_score), float(sharded.loss))]
    allowed = ctx.tolerances.parity_test_questions / len(sentences) + 1e-9
    problems = [
        f"{label} scores {score} against flair's {reference}"
        for label, runs in scores.items()
        for score in runs
        if abs(score[0] - reference[0]) > allowed or relative_difference(score[1], reference[1]) > 1e-4
    ]
    medians = {label: statistics.median(values) for label, values in timings.items()}
    ratio = medians["flair_fabric"] / medians["flair"]
    text = (
        f"{len(sentences)} questions, batch {sizes.batch}: main score {reference[0]:.4f} and loss {reference[1]:.4f}"
        f" agree in every run{' (incl. 2 processes)' if two else ''} (tolerance"
        f" {ctx.tolerances.parity_test_questions} question(s), loss 1e-4 relative); median s flair"
        f" {medians['flair']:.3f},"
        f" flair_fabric.evaluate(devices=1) {medians['flair_fabric']:.3f} (ratio {ratio:.3f})"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else text,
        seconds=timings,
        scores=scores,
        time_ratio_fabric_over_flair=ratio,
    )


def unit_evaluate(ctx: Context) -> Iterator[dict]:
    """The evaluation unit."""
    yield guarded("evaluate_vs_flair", lambda: check_evaluate(ctx))
