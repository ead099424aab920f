"""Strategies: "ddp" (one and two processes), "fsdp", FlairFSDPStrategy(cpu_offload=True), "fsdp" for a model built
on the CPU, Lightning's own FSDPStrategy object and "deepspeed": each trains, writes a final-model.pt that flair's
``TextClassifier.load`` reads, and the loaded model scores like the trained one."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from common import state_dict_difference

from .context import Context, guarded, result
from .plugins import plugin
from .processes import probe_failure, run_probe
from .settings import FAILED, PASSED, PROBE_TIMEOUT_S, SKIPPED
from .training import build_classifier, fabric_args, fine_tune, peak_memory, trec


def train_and_reload(
    ctx: Context,
    name: str,
    *,
    strategy: Any,
    devices: int,
    expected_world_size: int,
    expected_backend: str | None = None,
    build_on_cpu: bool = False,
) -> dict:
    """Train one epoch with ``strategy``, then load final-model.pt with flair and score it like the trained model."""
    import flair
    import torch
    from flair.models import TextClassifier

    from flair_fabric import FabricTrainer
    from flair_fabric.datasets import TREC_LABEL_TYPE

    sizes = ctx.sizes("strategy")
    corpus = trec(sizes)
    flair.device = torch.device("cpu") if build_on_cpu else ctx.device
    model = build_classifier(ctx, corpus)
    base, run_file = ctx.work / name, ctx.work / f"{name}-run.json"
    started = time.perf_counter()
    with peak_memory(ctx) as memory:
        trainer = FabricTrainer(model, corpus)
        recorder = plugin("RunRecorder", str(run_file))
        extra = fabric_args(ctx, devices=devices, strategy=strategy)
        returned = fine_tune(trainer, base, sizes, [recorder], save_final_model=True, **extra)
    train_seconds = round(time.perf_counter() - started, 2)
    run = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    final = base / "final-model.pt"
    loaded = TextClassifier.load(final)
    test: Any = corpus.test
    # return_loss=False as in the trainers' final test: with a loss, flair leaves out (does not predict) questions
    # whose gold label the training split lacks, and the scores would differ on small splits
    loaded_accuracy = loaded.evaluate(
        test, gold_label_type=TREC_LABEL_TYPE, mini_batch_size=sizes.batch, return_loss=False
    )
    trained_accuracy = float(returned["test_score"])
    weight_diff = state_dict_difference(model.state_dict(), loaded.state_dict())
    allowed = ctx.tolerances.parity_test_questions / sizes.test + 1e-9
    problems = []
    if run.get("world_size") != expected_world_size:
        problems.append(f"trained with world size {run.get('world_size')}, expected {expected_world_size}")
    if expected_backend is not None and run.get("backend") != expected_backend:
        problems.append(f"process group backend {run.get('backend')!r}, expected {expected_backend!r}")
    if abs(loaded_accuracy.main_score - trained_accuracy) > allowed:
        problems.append(f"loaded model scores {loaded_accuracy.main_score:.4f}, trained {trained_accuracy:.4f}")
    if not weight_diff <= 1e-6:
        problems.append(f"the caller's model and final-model.pt differ by {weight_diff:.2e}")
    summary = (
        f"world size {run.get('world_size')}, {run.get('strategy')}, backend {run.get('backend')}; final-model.pt"
        f" ({final.stat().st_size / 2**20:.0f} MiB) loads with TextClassifier.load, test accuracy"
        f" {loaded_accuracy.main_score:.4f} = trained {trained_accuracy:.4f}; caller's weights max |diff|"
        f" {weight_diff:.0e}"
    )
    peak = memory["peak_gpu_memory_mib"] if run.get("world_size") == 1 else run.get("peak_gpu_memory_mib")
    return result(
        name,
        FAILED if problems else PASSED,
        "; ".join(problems) if problems else summary,
        run=run,
        devices=devices,
        strategy=strategy if isinstance(strategy, str) else type(strategy).__name__,
        test_accuracy_trained=trained_accuracy,
        test_accuracy_loaded=loaded_accuracy.main_score,
        weight_difference=weight_diff,
        train_seconds=train_seconds,
        memory={f"{name} (global rank 0)": peak},
    )


def unit_ddp_one_process(ctx: Context) -> Iterator[dict]:
    """strategy="ddp" in one process (NCCL on a GPU)."""
    name = "strategy_ddp_1_process_nccl"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy="ddp", devices=1, expected_world_size=1, expected_backend="nccl" if ctx.cuda else None
        ),
    )


def unit_ddp_two_processes(ctx: Context) -> Iterator[dict]:
    """Two ranks: forked CPU processes (gloo) in the dry run, the script relaunch over two GPUs (NCCL) on a GPU."""
    name = "strategy_ddp_2_processes"
    strategy, backend = ("ddp", "nccl") if ctx.cuda else ("ddp_fork", "gloo")
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=strategy, devices=2, expected_world_size=2, expected_backend=backend
        ),
    )


def unit_fsdp(ctx: Context) -> Iterator[dict]:
    """FlairFSDPStrategy: over min(2, GPUs) GPUs, or two forked CPU processes in the dry run."""
    from flair_fabric import FlairFSDPStrategy

    name = "strategy_fsdp"
    if ctx.cuda:
        devices = min(2, ctx.gpus)
        strategy: Any = "fsdp"
        backend = "nccl"
    else:
        devices, strategy, backend = 2, FlairFSDPStrategy(start_method="fork"), "gloo"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=strategy, devices=devices, expected_world_size=devices, expected_backend=backend
        ),
    )


def unit_fsdp_cpu_offload(ctx: Context) -> Iterator[dict]:
    """FlairFSDPStrategy(cpu_offload=True) on one GPU."""
    from flair_fabric import FlairFSDPStrategy

    name = "strategy_fsdp_cpu_offload"
    yield guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy=FlairFSDPStrategy(cpu_offload=True), devices=1, expected_world_size=1
        ),
    )


def unit_fsdp_model_on_cpu(ctx: Context) -> Iterator[dict]:
    """The model is built with flair.device = cpu (as a notebook that forks workers must do), then trained on the
    GPU with "fsdp": the evaluation during training uses the caller's model, which FSDP fills with whole weights."""
    name = "strategy_fsdp_model_built_on_cpu"
    yield guarded(
        name,
        lambda: train_and_reload(ctx, name, strategy="fsdp", devices=1, expected_world_size=1, build_on_cpu=True),
    )


def check_lightning_fsdp(ctx: Context) -> dict:
    """Lightning's own FSDPStrategy object: trains and saves, or is refused at once with a clear error."""
    from lightning.fabric.strategies import FSDPStrategy

    name = "strategy_lightning_fsdp_object"
    strategy = FSDPStrategy(cpu_offload=True) if ctx.cuda else FSDPStrategy()
    described = "FSDPStrategy(cpu_offload=True)" if ctx.cuda else "FSDPStrategy()"
    started = time.perf_counter()
    try:
        row = train_and_reload(ctx, name, strategy=strategy, devices=1, expected_world_size=1)
    except ValueError as error:
        seconds = time.perf_counter() - started
        clear = "FSDPStrategy" in str(error) and seconds < 60
        reason = (
            f"FabricTrainer refuses Lightning's {described} at once ({seconds:.1f} s, before any process or device"
            f" work; not trained): {error}"
        )
        return result(
            name, PASSED if clear else FAILED, reason, accepted=False, error=str(error), seconds_to_error=seconds
        )
    row["measurements"]["accepted"] = True
    row["reason"] = f"FabricTrainer accepts Lightning's {described}: " + row["reason"]
    return row


def unit_lightning_fsdp(ctx: Context) -> Iterator[dict]:
    """Lightning's own FSDPStrategy object."""
    yield guarded("strategy_lightning_fsdp_object", lambda: check_lightning_fsdp(ctx))


def ensure_deepspeed(ctx: Context) -> tuple[bool, str]:
    """Whether ``deepspeed`` can be imported, pip-installing it if there is time; and what happened."""
    if importlib.util.find_spec("deepspeed") is not None:
        return True, f"deepspeed {importlib.metadata.version('deepspeed')} was installed already"
    timeout = min(120.0, ctx.seconds_left() - PROBE_TIMEOUT_S - 10)
    if timeout < 20:
        return False, "deepspeed is not installed and no time is left to pip-install it"
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    command += ["--retries", "0", "--timeout", "10", "deepspeed"]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"deepspeed is not installed and `pip install deepspeed` did not finish within {timeout:.0f} s"
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr).strip().splitlines()
        return False, f"`pip install deepspeed` failed (exit {completed.returncode}): {' / '.join(output[-3:])[:600]}"
    return True, f"deepspeed {importlib.metadata.version('deepspeed')} was pip-installed for this check"


def check_deepspeed(ctx: Context) -> dict:
    """strategy="deepspeed" in a probe process (its own timeout), installing deepspeed first if need be."""
    name = "strategy_deepspeed_stage_2"
    available, how = ensure_deepspeed(ctx)
    if not available:
        return result(name, SKIPPED, how, install=how)
    outcome = run_probe(ctx, "deepspeed_train", min(PROBE_TIMEOUT_S * 2, ctx.seconds_left() - 5))
    row = outcome.get("payload")
    if outcome["outcome"] != "finished" or not isinstance(row, dict):
        return result(name, FAILED, probe_failure(outcome), install=how, probe=outcome)
    row["measurements"]["install"] = how
    return row


def unit_deepspeed(ctx: Context) -> Iterator[dict]:
    """DeepSpeed ZeRO stage 2."""
    yield guarded("strategy_deepspeed_stage_2", lambda: check_deepspeed(ctx))


def probe_deepspeed_train(ctx: Context) -> dict:
    """The deepspeed check's training, in the probe process."""
    name = "strategy_deepspeed_stage_2"
    return guarded(
        name,
        lambda: train_and_reload(
            ctx, name, strategy="deepspeed", devices=1, expected_world_size=1, expected_backend="nccl"
        ),
    )
