"""Parity: FabricTrainer(devices=1) against flair's ModelTrainer on the same seed and data."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from common import state_dict_difference

from .context import Context, guarded, result
from .settings import FAILED, PASSED, SEED, Sizes
from .training import (
    build_classifier,
    deterministic_settings,
    fabric_args,
    fine_tune,
    fmt,
    nondeterminism_warnings,
    peak_memory,
    recorded_warnings,
    relative_difference,
    trec,
)


def parity_side(ctx: Context, trainer_name: str, sizes: Sizes) -> dict[str, Any]:
    """Fine-tune one seeded classifier with flair's ModelTrainer or FabricTrainer(devices=1)."""
    import flair
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import MetricHistoryPlugin

    from flair_fabric import FabricTrainer

    corpus = trec(sizes)
    flair.device = ctx.device
    model = build_classifier(ctx, corpus)
    history = MetricHistoryPlugin()
    flair.set_seed(SEED)
    base = ctx.work / f"parity-{trainer_name}"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        if trainer_name == "flair":
            returned = fine_tune(ModelTrainer(model, corpus), base, sizes, [history])
        else:
            returned = fine_tune(FabricTrainer(model, corpus), base, sizes, [history], **fabric_args(ctx))
    weights = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    return {
        "losses": [float(x) for x in returned["train_loss_history"]],
        "dev_scores": [float(x) for x in returned.get("dev_score_history", [])],
        "test_accuracy": float(returned["test_score"]),
        "weights": weights,
        "seconds": round(time.perf_counter() - started, 2),
        **memory,
    }


def check_parity(ctx: Context) -> dict:
    """Both trainers fine-tune the same seeded model: losses, weights and test accuracy within the tolerances."""
    name = "parity_one_device"
    settings = deterministic_settings(ctx)
    sizes, tolerance = ctx.sizes("parity"), ctx.tolerances
    with recorded_warnings() as caught:
        flair_side = parity_side(ctx, "flair", sizes)
        fabric_side = parity_side(ctx, "fabric", sizes)
    pairs = list(zip(flair_side["losses"], fabric_side["losses"], strict=False))
    loss_rel = max((relative_difference(a, b) for a, b in pairs), default=math.inf)
    weight_diff = state_dict_difference(flair_side["weights"], fabric_side["weights"])
    accuracy_diff = abs(flair_side["test_accuracy"] - fabric_side["test_accuracy"])
    allowed_accuracy = tolerance.parity_test_questions / sizes.test + 1e-9
    problems = []
    if len(pairs) != sizes.epochs or len(flair_side["losses"]) != len(fabric_side["losses"]):
        problems.append(f"loss histories differ in length ({flair_side['losses']} vs {fabric_side['losses']})")
    if not loss_rel <= tolerance.parity_loss_rel:
        problems.append(f"per-epoch losses differ by {loss_rel:.2e} relative (tolerance {tolerance.parity_loss_rel})")
    if not weight_diff <= tolerance.parity_weight_abs:
        problems.append(f"final weights differ by {weight_diff:.2e} (tolerance {tolerance.parity_weight_abs})")
    if accuracy_diff > allowed_accuracy:
        problems.append(f"test accuracy differs by {accuracy_diff:.4f} (tolerance {allowed_accuracy:.4f})")
    summary = (
        f"{sizes.epochs} epochs: losses flair {fmt(flair_side['losses'])} / fabric {fmt(fabric_side['losses'])}"
        f" (max rel. diff {loss_rel:.1e}, tol {tolerance.parity_loss_rel:g}); weights max |diff| {weight_diff:.1e}"
        f" (tol {tolerance.parity_weight_abs:g}); test accuracy {flair_side['test_accuracy']:.4f} /"
        f" {fabric_side['test_accuracy']:.4f}"
    )
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        sizes=sizes.__dict__,
        tolerances={
            "loss_relative": tolerance.parity_loss_rel,
            "weight_absolute": tolerance.parity_weight_abs,
            "test_questions": tolerance.parity_test_questions,
        },
        deterministic_settings=settings,
        nondeterminism_warnings=nondeterminism_warnings(caught),
        losses={"flair": flair_side["losses"], "fabric": fabric_side["losses"]},
        dev_scores={"flair": flair_side["dev_scores"], "fabric": fabric_side["dev_scores"]},
        test_accuracy={"flair": flair_side["test_accuracy"], "fabric": fabric_side["test_accuracy"]},
        max_loss_relative_difference=loss_rel,
        max_weight_difference=weight_diff,
        seconds_per_trainer={"flair": flair_side["seconds"], "fabric": fabric_side["seconds"]},
        memory={
            "parity: flair ModelTrainer": flair_side["peak_gpu_memory_mib"],
            "parity: FabricTrainer(devices=1)": fabric_side["peak_gpu_memory_mib"],
        },
    )


def unit_parity(ctx: Context) -> Iterator[dict]:
    """The parity unit."""
    yield guarded("parity_one_device", lambda: check_parity(ctx))
