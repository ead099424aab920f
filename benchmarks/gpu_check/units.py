"""Every unit of the check (its checks, budgets and process settings) and every probe, in report order."""

from __future__ import annotations

from collections.abc import Callable

from .context import CheckSpec, Context, Unit
from .language_model import unit_language_model
from .memory_cap import unit_memory_cap
from .one_gpu import ONE_GPU_CUDA_REASONS, ONE_GPU_PROBES, ONE_GPU_TITLES, unit_one_gpu
from .one_gpu import PROBES as ONE_GPU_PROBE_FUNCTIONS
from .parity import unit_parity
from .precision import unit_precision
from .settings import CUBLAS_WORKSPACE, PROBE_TIMEOUT_S
from .strategies import (
    probe_deepspeed_train,
    unit_ddp_one_process,
    unit_ddp_two_processes,
    unit_deepspeed,
    unit_fsdp,
    unit_fsdp_cpu_offload,
    unit_fsdp_model_on_cpu,
    unit_lightning_fsdp,
)
from .throughput import unit_evaluate, unit_throughput

NEEDS_16 = "precision='16-mixed' needs a CUDA GPU (FabricTrainer refuses it on CPU)"
UNITS: tuple[Unit, ...] = (
    Unit(
        "throughput",
        (
            CheckSpec("throughput_batch_32", "ModelTrainer vs FabricTrainer(devices=1), samples/s, batch 32"),
            CheckSpec("throughput_batch_128", "ModelTrainer vs FabricTrainer(devices=1), samples/s, batch 128"),
        ),
        unit_throughput,
        budget_s=150,
        dry_budget_s=60,
        exclusive=True,
    ),
    Unit(
        "evaluate",
        (CheckSpec("evaluate_vs_flair", "flair_fabric.evaluate vs flair's evaluate"),),
        unit_evaluate,
        budget_s=60,
        dry_budget_s=45,
        exclusive=True,
    ),
    Unit(
        "parity",
        (CheckSpec("parity_one_device", "FabricTrainer(devices=1) vs ModelTrainer: losses, weights, accuracy"),),
        unit_parity,
        budget_s=120,
        dry_budget_s=60,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
    Unit(
        "precision",
        (
            CheckSpec("precision_32_true", "precision='32-true' (the reference)"),
            CheckSpec("precision_bf16_mixed", "precision='bf16-mixed'"),
            CheckSpec("precision_bf16_true", "precision='bf16-true'"),
            CheckSpec("precision_use_amp", "flair's use_amp=True, mapped by FabricTrainer"),
            CheckSpec("precision_16_mixed_overflow", "precision='16-mixed' with a forced overflow step", NEEDS_16),
        ),
        unit_precision,
        budget_s=210,
        dry_budget_s=90,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
    Unit(
        "lightning_fsdp",
        (CheckSpec("strategy_lightning_fsdp_object", "Lightning's FSDPStrategy object (cpu_offload=True on a GPU)"),),
        unit_lightning_fsdp,
        budget_s=60,
        dry_budget_s=45,
    ),
    Unit(
        "ddp_one_process",
        (
            CheckSpec(
                "strategy_ddp_1_process_nccl",
                "strategy='ddp', one process, NCCL",
                "NCCL, the backend of GPU process groups, needs CUDA",
            ),
        ),
        unit_ddp_one_process,
        budget_s=90,
        dry_budget_s=45,
    ),
    Unit(
        "fsdp",
        (CheckSpec("strategy_fsdp", "strategy='fsdp' (FlairFSDPStrategy)"),),
        unit_fsdp,
        budget_s=120,
        dry_budget_s=60,
    ),
    Unit(
        "fsdp_cpu_offload",
        (
            CheckSpec(
                "strategy_fsdp_cpu_offload",
                "FlairFSDPStrategy(cpu_offload=True)",
                "cpu_offload moves shards between a GPU and the CPU (FabricTrainer refuses it on CPU)",
            ),
        ),
        unit_fsdp_cpu_offload,
        budget_s=120,
        dry_budget_s=45,
    ),
    Unit(
        "fsdp_model_on_cpu",
        (
            CheckSpec(
                "strategy_fsdp_model_built_on_cpu",
                "strategy='fsdp' on a GPU for a model built on the CPU",
                "the model's device differs from the training device only when training on a GPU",
            ),
        ),
        unit_fsdp_model_on_cpu,
        budget_s=120,
        dry_budget_s=45,
    ),
    Unit(
        "ddp_two_processes",
        (CheckSpec("strategy_ddp_2_processes", "strategy='ddp' with two processes (two GPUs, or 2 CPU processes)"),),
        unit_ddp_two_processes,
        budget_s=120,
        dry_budget_s=60,
        min_gpus=2,
    ),
    Unit(
        "one_gpu",
        tuple(
            CheckSpec(name, ONE_GPU_TITLES[probe], ONE_GPU_CUDA_REASONS.get(probe, "processes sharing one CUDA device"))
            for name, probe, _ in ONE_GPU_PROBES
        ),
        unit_one_gpu,
        budget_s=PROBE_TIMEOUT_S + 40,
        dry_budget_s=30,
    ),
    Unit(
        "deepspeed",
        (
            CheckSpec(
                "strategy_deepspeed_stage_2",
                "strategy='deepspeed' (ZeRO stage 2)",
                "DeepSpeed needs a CUDA GPU (FabricTrainer refuses it on CPU) and the deepspeed package",
            ),
        ),
        unit_deepspeed,
        budget_s=300,
        dry_budget_s=30,
        exclusive=True,  # it may pip-install into the environment the other units use
    ),
    Unit(
        "language_model",
        (
            CheckSpec("language_model_parity", "FabricLanguageModelTrainer(devices=1) vs LanguageModelTrainer"),
            CheckSpec("language_model_bf16_mixed", "FabricLanguageModelTrainer, precision='bf16-mixed'"),
            CheckSpec("language_model_16_mixed", "FabricLanguageModelTrainer, precision='16-mixed'", NEEDS_16),
        ),
        unit_language_model,
        budget_s=150,
        dry_budget_s=45,
        env={"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE},
    ),
    Unit(
        "memory_cap",
        (
            CheckSpec(
                "chunks_under_memory_cap",
                "mini_batch_chunk_size under a memory cap that whole batches exceed",
                "caps the process's CUDA memory (torch.cuda.set_per_process_memory_fraction)",
            ),
            CheckSpec(
                "auto_chunks_under_memory_cap",
                "mini_batch_chunk_size='auto' catches a real out-of-memory error under that cap",
                "caps the process's CUDA memory (torch.cuda.set_per_process_memory_fraction)",
            ),
        ),
        unit_memory_cap,
        budget_s=180,
        dry_budget_s=10,
    ),
)
UNITS_BY_NAME = {unit.name: unit for unit in UNITS}
CHECKS = [(unit, check) for unit in UNITS for check in unit.checks]


PROBES: dict[str, Callable[[Context], dict]] = {**ONE_GPU_PROBE_FUNCTIONS, "deepspeed_train": probe_deepspeed_train}
