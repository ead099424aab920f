"""The language-model trainer: FabricLanguageModelTrainer(devices=1) against flair's LanguageModelTrainer from the
same seed, and FabricLanguageModelTrainer under "bf16-mixed" and "16-mixed"."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import state_dict_difference

from .context import Context, guarded, result
from .settings import FAILED, PASSED, REPO
from .training import deterministic_settings, peak_memory, relative_difference

LM_OPTIONS = {"sequence_length": 100, "mini_batch_size": 32, "max_epochs": 1, "num_workers": 0, "learning_rate": 20.0}
LM_SEED = 5


def language_model_corpus(ctx: Context) -> Any:
    """Persuasion cut by examples/language_model/prepare_corpus.py into train split files, valid.txt and test.txt
    (2 split files on a GPU; in the dry run 1, cut to 20,000 characters, and held-out texts of 4,000)."""
    from flair.data import Dictionary
    from flair.trainers.language_model_trainer import TextCorpus

    examples_on_path()
    from prepare_corpus import austen_dir, prepare_corpus

    folder = ctx.work / "lm-corpus"
    if not folder.exists():
        prepare_corpus(folder, sources=[austen_dir() / "persuasion.txt"], splits=2, valid_fraction=0.05)
        if ctx.dry:
            (folder / "train" / "train_split_2").unlink()
            for path, size in ((folder / "train" / "train_split_1", 20_000), (folder / "valid.txt", 4_000)):
                path.write_text(path.read_text(encoding="utf-8")[:size], encoding="utf-8")
            (folder / "test.txt").write_text((folder / "valid.txt").read_text(encoding="utf-8"), encoding="utf-8")
    return TextCorpus(folder, Dictionary.load_from_file(folder / "chars.pkl"), forward=True, character_level=True)


def examples_on_path() -> None:
    """examples/language_model (prepare_corpus, demo_lm) importable, once."""
    folder = str(REPO / "examples" / "language_model")
    if folder not in sys.path:
        sys.path.insert(0, folder)


def seed_language_model_run() -> None:
    """The generators flair's LanguageModelTrainer draws from (the split order, the line shuffles), seeded alike."""
    import random

    import torch

    random.seed(LM_SEED)
    torch.manual_seed(LM_SEED)


def language_model(ctx: Context, corpus: Any) -> Any:
    """A seeded forward character LSTM (flair's LanguageModel) for ``corpus``."""
    import torch
    from flair.models import LanguageModel

    torch.manual_seed(LM_SEED)
    hidden = 32 if ctx.dry else 1024  # on a GPU the size of flair's published character models
    return LanguageModel(corpus.dictionary, is_forward_lm=True, hidden_size=hidden, nlayers=1, dropout=0.0)


def validation_perplexities(run: Path) -> list[float]:
    """flair's loss.txt: the validation perplexity after each split."""
    lines = (run / "loss.txt").read_text(encoding="utf-8").splitlines()
    return [float(line.split("valid ppl")[1].split("|")[0]) for line in lines if "valid ppl" in line]


def check_language_model_parity(ctx: Context) -> dict:
    """flair's LanguageModelTrainer and FabricLanguageModelTrainer(devices=1) from the same seed: validation
    perplexities and final weights."""
    import flair
    from flair.trainers.language_model_trainer import LanguageModelTrainer

    from flair_fabric import FabricLanguageModelTrainer

    name, tol = "language_model_parity", ctx.tolerances
    deterministic_settings(ctx)
    flair.device = ctx.device
    corpus = language_model_corpus(ctx)
    theirs, ours = language_model(ctx, corpus), language_model(ctx, corpus)
    seed_language_model_run()
    LanguageModelTrainer(theirs, corpus).train(ctx.work / "lm-flair", **LM_OPTIONS)
    seed_language_model_run()
    FabricLanguageModelTrainer(ours, corpus).train(
        ctx.work / "lm-fabric", accelerator=ctx.accelerator, devices=1, **LM_OPTIONS
    )
    weights = state_dict_difference(theirs.state_dict(), ours.state_dict())
    flair_ppl = validation_perplexities(ctx.work / "lm-flair")
    fabric_ppl = validation_perplexities(ctx.work / "lm-fabric")
    same_count = len(fabric_ppl) == len(flair_ppl) > 0
    pairs = zip(fabric_ppl, flair_ppl, strict=False)  # same_count is checked
    ppl_rel = max(relative_difference(a, b) for a, b in pairs) if same_count else math.inf
    ok = same_count and ppl_rel <= tol.parity_loss_rel and weights <= tol.parity_weight_abs
    text = (
        f"validation perplexities in loss.txt: flair {flair_ppl} / fabric {fabric_ppl} (max rel. diff"
        f" {ppl_rel:.1e}, tol {tol.parity_loss_rel:g}); weights max |diff| {weights:.1e}"
        f" (tol {tol.parity_weight_abs:g})"
    )
    return result(name, PASSED if ok else FAILED, text, flair=flair_ppl, fabric=fabric_ppl, weight_difference=weights)


def check_language_model_precision(ctx: Context, precision: str) -> dict:
    """FabricLanguageModelTrainer(devices=1) under ``precision``: the validation perplexity falls, the weights stay
    finite, best-lm.pt loads with flair."""
    import flair
    import torch
    from flair.models import LanguageModel

    from flair_fabric import FabricLanguageModelTrainer

    name = "language_model_" + precision.replace("-", "_")
    flair.device = ctx.device
    corpus = language_model_corpus(ctx)
    model = language_model(ctx, corpus)
    examples_on_path()
    from demo_lm import validation_perplexity  # flair's own evaluate, one process

    columns, length = int(LM_OPTIONS["mini_batch_size"]), int(LM_OPTIONS["sequence_length"])
    untrained = validation_perplexity(model, corpus, columns, length)
    seed_language_model_run()
    with peak_memory(ctx) as memory:
        FabricLanguageModelTrainer(model, corpus).train(
            ctx.work / f"lm-{precision}", accelerator=ctx.accelerator, devices=1, precision=precision, **LM_OPTIONS
        )
    trained = validation_perplexities(ctx.work / f"lm-{precision}")
    finite = all(bool(torch.isfinite(tensor).all()) for tensor in model.state_dict().values())
    loaded = LanguageModel.load_language_model(ctx.work / f"lm-{precision}" / "best-lm.pt")
    ok = finite and bool(trained) and trained[-1] < untrained and loaded is not None
    text = (
        f"validation perplexity {untrained:.2f} untrained -> {trained} after each split; weights finite: {finite};"
        " best-lm.pt loads with LanguageModel.load_language_model"
    )
    return result(name, PASSED if ok else FAILED, text, untrained=untrained, trained=trained, **memory)


def unit_language_model(ctx: Context) -> Iterator[dict]:
    """Parity, then the precisions."""
    yield guarded("language_model_parity", lambda: check_language_model_parity(ctx))
    yield guarded("language_model_bf16_mixed", lambda: check_language_model_precision(ctx, "bf16-mixed"))
    if ctx.cuda:
        yield guarded("language_model_16_mixed", lambda: check_language_model_precision(ctx, "16-mixed"))
