"""When each check passes, in words, with this run's tolerances and sizes (the report's "criteria")."""

from __future__ import annotations

from .language_model import LM_OPTIONS
from .one_gpu import ONE_GPU_PROBES
from .settings import PROBE_TIMEOUT_S, Sizes, Tolerances

STRATEGY_CHECKS = (
    "strategy_lightning_fsdp_object",
    "strategy_ddp_1_process_nccl",
    "strategy_fsdp",
    "strategy_fsdp_cpu_offload",
    "strategy_fsdp_model_built_on_cpu",
    "strategy_ddp_2_processes",
    "strategy_deepspeed_stage_2",
)
ONE_GPU_EXPECTED = {name: expected for name, _, expected in ONE_GPU_PROBES}


def criterion(name: str, tol: Tolerances, sizes: dict[str, Sizes], dry: bool) -> str:
    """When check ``name`` passes, with this run's tolerances and sizes (for the report)."""
    parity, precision, strategy = sizes["parity"], sizes["precision"], sizes["strategy"]
    questions = f"{tol.parity_test_questions} test question(s)"
    if tol.accuracy_points is None:
        accuracy = "test accuracy against 32-true recorded, not judged (tiny model)"
    else:
        accuracy = f"test accuracy within {tol.accuracy_points:g} point(s) of 32-true"
    falls = (
        f"the train loss of the last of {precision.epochs} epochs is below the first's ({precision.train} questions,"
        f" batch {precision.batch}, learning rate {precision.learning_rate:g}, the same seed and initial weights for"
        " every precision), losses and weights finite"
    )
    strategy_rule = (
        f"trains {strategy.epochs} epoch on {strategy.train} questions with the expected world size and process group"
        " backend, writes final-model.pt, which flair's TextClassifier.load reads; the loaded model's test accuracy"
        f" equals the trained one's (at most {questions} apart) and the caller's weights equal the saved ones (1e-6)"
    )
    if name == "parity_one_device":
        return (
            f"flair's ModelTrainer and FabricTrainer(devices=1) fine-tune the same seeded model ({parity.train}"
            f" questions, {parity.epochs} epochs, batch {parity.batch}, deterministic settings): per-epoch train losses"
            f" within {tol.parity_loss_rel:g} relative, every final weight within {tol.parity_weight_abs:g} absolute,"
            f" test accuracies at most {questions} apart"
        )
    if name == "precision_32_true":
        return f"the reference run: {falls}"
    if name in ("precision_bf16_mixed", "precision_bf16_true"):
        return f"{falls}; {accuracy}"
    if name == "precision_use_amp":
        mapped = "bf16-mixed on CPU" if dry else "16-mixed on CUDA"
        return (
            f"FabricTrainer maps use_amp=True to {mapped} and its per-epoch losses are within {tol.amp_loss_rel:g}"
            f" relative of flair's own use_amp=True run; {falls}; {accuracy}"
        )
    if name == "precision_16_mixed_overflow":
        return (
            "a gradient set to inf before optimizer step 5: the scaler skips that step (loss scale halved), the"
            " trainer reports optimizer_was_run=False, every step's optimizer_was_run agrees with the scaler, flair's"
            " LinearSchedulerPlugin advances exactly on the steps that ran, no parameter becomes NaN; and " + falls
        )
    if name == "strategy_lightning_fsdp_object":
        return (
            f"either it {strategy_rule}, or FabricTrainer refuses it within 60 s with a ValueError naming FSDPStrategy"
        )
    if name == "strategy_deepspeed_stage_2":
        return f"it {strategy_rule}; skipped when deepspeed is neither importable nor pip-installable in time"
    if name in STRATEGY_CHECKS:
        return f"it {strategy_rule}"
    if name in ONE_GPU_EXPECTED:
        expected = ONE_GPU_EXPECTED[name]
        rule = {
            "refused": "refused with an exception, at once",
            "works": "works (both ranks train)",
            "answers": "works, or fails with a clear error",
        }[expected]
        return f"{rule}; in its own process with a {PROBE_TIMEOUT_S:.0f} s timeout, so a hang fails instead of stopping"
    if name.startswith("throughput_batch_"):
        goal = (
            "recorded, not judged (tiny model on CPU)" if tol.throughput_ratio is None else f"<= {tol.throughput_ratio}"
        )
        throughput = sizes["throughput"]
        pairs = "1 pair" if dry else "the median of 3 ABBA pairs after a warm-up"
        return (
            f"FabricTrainer's epoch time / ModelTrainer's ({throughput.train} questions, batch"
            f" {name.rsplit('_', 1)[1]}, {pairs}) {goal}; device synchronisations per step recorded (CUDA)"
        )
    if name == "evaluate_vs_flair":
        return (
            f"flair_fabric.evaluate (1 process, and 2 where possible) gives flair's main score (at most"
            f" {tol.parity_test_questions} question(s) apart) and loss (1e-4 relative); time ratio recorded"
        )
    if name == "language_model_parity":
        return (
            "flair's LanguageModelTrainer and FabricLanguageModelTrainer(devices=1) train the same seeded"
            f" character LSTM (hidden {32 if dry else 1024}, {LM_OPTIONS['mini_batch_size']} columns, sequence length"
            f" {LM_OPTIONS['sequence_length']}, one epoch over Persuasion's split files, deterministic settings):"
            f" validation perplexities within {tol.parity_loss_rel:g} relative, every final weight within"
            f" {tol.parity_weight_abs:g} absolute"
        )
    if name.startswith("language_model_"):
        return (
            "FabricLanguageModelTrainer(devices=1) under this precision: the validation perplexity after training is"
            " below the untrained model's, every weight finite, best-lm.pt loads with LanguageModel.load_language_model"
        )
    return "see the check's reason"
