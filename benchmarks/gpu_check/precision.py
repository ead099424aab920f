"""Precision: "32-true", "bf16-mixed", "bf16-true", flair's use_amp=True and "16-mixed" with a forced overflow."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from typing import Any

from .context import Context, guarded, result
from .plugins import plugin
from .settings import FAILED, PASSED, SEED, Sizes
from .training import (
    all_finite,
    build_classifier,
    deterministic_settings,
    fabric_args,
    fine_tune,
    fmt,
    peak_memory,
    relative_difference,
    trec,
)


def precision_run(ctx: Context, sizes: Sizes, label: str, trainer_name: str = "fabric", **options: Any) -> dict:
    """One fine-tuning run (``options``: ``precision=``, ``use_amp=``, ``plugins=``); losses, accuracy, memory."""
    import flair
    import torch
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import MetricHistoryPlugin

    from flair_fabric import FabricTrainer

    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    history = MetricHistoryPlugin()
    plugins = [history, *options.pop("plugins", [])]
    flair.set_seed(SEED)
    base = ctx.work / f"precision-{label}"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            returned = fine_tune(ModelTrainer(model, corpus), base, sizes, plugins, **options)
        else:
            returned = fine_tune(FabricTrainer(model, corpus), base, sizes, plugins, **fabric_args(ctx), **options)
    parameters = list(model.parameters())
    card = (model.model_card or {}).get("training_parameters", {})
    return {
        "label": label,
        "losses": [float(x) for x in returned["train_loss_history"]],
        "test_accuracy": float(returned["test_score"]),
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in parameters),
        "parameter_dtype": str(parameters[0].dtype),
        "precision_used": card.get("precision"),
        "seconds": round(time.perf_counter() - started, 2),
        **memory,
    }


def judge_precision(name: str, ctx: Context, run: dict, baseline: dict | None, extra: list[str] | None = None) -> dict:
    """Loss falls, everything finite, test accuracy within the tolerance of "32-true"."""
    losses = run["losses"]
    problems = list(extra or [])
    if not all_finite(losses) or not run["weights_finite"]:
        problems.append(f"not finite: losses {losses}, weights finite {run['weights_finite']}")
    if len(losses) < 2 or not losses[-1] < losses[0]:
        problems.append(f"the loss does not fall: {fmt(losses)}")
    tolerance = ctx.tolerances.accuracy_points
    points = None
    if baseline is None:
        problems.append("no 32-true run to compare with")
    else:
        points = 100 * (run["test_accuracy"] - baseline["test_accuracy"])
        if tolerance is not None and abs(points) > tolerance:
            problems.append(f"test accuracy {points:+.2f} points from 32-true (tolerance {tolerance})")
    judged = "recorded, not judged (tiny model)" if tolerance is None else f"tol {tolerance} point"
    summary = (
        f"loss {fmt(losses)}, test accuracy {run['test_accuracy']:.4f}"
        + (f" ({points:+.2f} points vs 32-true, {judged})" if points is not None else "")
        + f", precision {run['precision_used']}, parameters {run['parameter_dtype']}"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        run=run,
        accuracy_points_vs_32_true=points,
        accuracy_tolerance_points=tolerance,
        memory={f"precision: {run['label']}": run["peak_gpu_memory_mib"]},
    )


def check_use_amp(ctx: Context, sizes: Sizes, baseline: dict | None) -> dict:
    """FabricTrainer(use_amp=True) picks 16-mixed on CUDA (bf16-mixed on CPU) and trains like flair's use_amp."""
    expected = "16-mixed" if ctx.cuda else "bf16-mixed"
    fabric_run = precision_run(ctx, sizes, "use_amp (FabricTrainer)", use_amp=True)
    flair_run = precision_run(ctx, sizes, "use_amp (flair ModelTrainer)", trainer_name="flair", use_amp=True)
    pairs = list(zip(fabric_run["losses"], flair_run["losses"], strict=False))
    loss_rel = max((relative_difference(a, b) for a, b in pairs), default=math.inf)
    problems = []
    if fabric_run["precision_used"] != expected:
        problems.append(f"use_amp=True trained with precision {fabric_run['precision_used']!r}, not {expected!r}")
    if not loss_rel <= ctx.tolerances.amp_loss_rel:
        problems.append(
            f"per-epoch losses differ from flair's use_amp run by {loss_rel:.2e} relative"
            f" (tolerance {ctx.tolerances.amp_loss_rel}): {fmt(fabric_run['losses'])} vs {fmt(flair_run['losses'])}"
        )
    row = judge_precision("precision_use_amp", ctx, fabric_run, baseline, problems)
    row["measurements"].update(
        flair_use_amp_run=flair_run,
        expected_precision=expected,
        loss_relative_difference_vs_flair=loss_rel,
        memory={
            "precision: use_amp (FabricTrainer)": fabric_run["peak_gpu_memory_mib"],
            "precision: use_amp (flair ModelTrainer)": flair_run["peak_gpu_memory_mib"],
        },
    )
    if row["status"] == PASSED:
        row["reason"] = f"mapped to {expected}, losses match flair's use_amp within {loss_rel:.1e}; " + row["reason"]
    return row


def check_overflow(ctx: Context, sizes: Sizes, baseline: dict | None, at_step: int = 5) -> dict:
    """16-mixed with one forced overflow: that step is skipped (scale halved, ``optimizer_was_run=False``, flair's
    scheduler held), every step's ``optimizer_was_run`` agrees with the scaler (natural overflows at the start are
    normal), the scheduler steps exactly when the optimizer did, and nothing becomes NaN."""
    probe = plugin("OverflowProbe", at_step)
    run = precision_run(ctx, sizes, "16-mixed", precision="16-mixed", plugins=[probe])
    steps = sorted(probe.optimizer_was_run)
    positions = [probe.scheduler_position.get(step) for step in steps] + [probe.final_position]
    advances = {step: _advance(positions[i], positions[i + 1]) for i, step in enumerate(steps)}
    before, after = probe.scale_before.get(at_step), probe.scale_after.get(at_step)
    problems = []
    if probe.optimizer_was_run.get(at_step) is not False:
        problems.append(f"optimizer_was_run at the forced overflow was {probe.optimizer_was_run.get(at_step)!r}")
    if before is None or after != before * 0.5:
        problems.append(f"the loss scale went {before} -> {after} at the forced overflow (expected halved)")
    if probe.finite_after_skip is not True:
        problems.append("a parameter is not finite after the skipped step")
    disagree = [s for s in steps if probe.optimizer_was_run[s] != _scale_kept(probe, s)]
    if disagree:
        problems.append(f"optimizer_was_run disagrees with the gradient scaler at steps {disagree[:10]}")
    unscheduled = [s for s in steps if advances[s] != (1 if probe.optimizer_was_run[s] else 0)]
    if unscheduled:
        problems.append(f"flair's LinearSchedulerPlugin did not step exactly with the optimizer at {unscheduled[:10]}")
    skipped = [s for s in steps if probe.optimizer_was_run[s] is False]
    row = judge_precision("precision_16_mixed_overflow", ctx, run, baseline, problems)
    row["measurements"].update(
        overflow_step=at_step,
        poisoned_gradient=probe.poisoned,
        skipped_steps=skipped,
        optimizer_was_run={str(k): v for k, v in probe.optimizer_was_run.items()},
        scheduler_advance_per_step={str(k): v for k, v in advances.items()},
        loss_scale_before_after={str(s): [probe.scale_before.get(s), probe.scale_after.get(s)] for s in steps},
        parameters_finite_after_skip=probe.finite_after_skip,
    )
    if row["status"] == PASSED:
        row["reason"] = (
            f"step {at_step} (gradient of {probe.poisoned} set to inf): skipped, scale {before:g} -> {after:g},"
            f" optimizer_was_run=False, scheduler held; skipped steps {skipped} all agree with the scaler and the"
            " scheduler; " + row["reason"]
        )
    return row


def _scale_kept(probe: Any, step: int) -> bool | None:
    """Whether the loss scale did not fall at ``step`` (what a step the scaler did not skip looks like)."""
    before, after = probe.scale_before.get(step), probe.scale_after.get(step)
    return None if before is None or after is None else after >= before


def _advance(before: int | None, after: int | None) -> int | None:
    """How far the scheduler moved."""
    return None if before is None or after is None else after - before


def check_precision(ctx: Context, sizes: Sizes, name: str, precision: str, baseline: dict | None) -> dict:
    """One precision, judged against the "32-true" run."""
    return judge_precision(name, ctx, precision_run(ctx, sizes, precision, precision=precision), baseline)


def unit_precision(ctx: Context) -> Iterator[dict]:
    """ "32-true" first (the baseline of the others), then the other precisions."""
    deterministic_settings(ctx)
    sizes = ctx.sizes("precision")
    baseline: dict | None = None

    def run_baseline() -> dict:
        nonlocal baseline
        baseline = precision_run(ctx, sizes, "32-true", precision="32-true")
        return judge_precision("precision_32_true", ctx, baseline, baseline)

    yield guarded("precision_32_true", run_baseline)
    for name, precision in (("precision_bf16_mixed", "bf16-mixed"), ("precision_bf16_true", "bf16-true")):
        yield guarded(name, functools.partial(check_precision, ctx, sizes, name, precision, baseline))
    yield guarded("precision_use_amp", lambda: check_use_amp(ctx, sizes, baseline))
    if ctx.cuda:
        yield guarded("precision_16_mixed_overflow", lambda: check_overflow(ctx, sizes, baseline))
