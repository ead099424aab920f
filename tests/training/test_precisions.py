"""Every precision name Fabric accepts, against each entry point: it runs or is refused before any process starts,
with the precision named; and a run in one precision leaves the caller's corpus usable by a run in another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier

from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC_LABEL_TYPE

from ..support import FABRIC_PRECISIONS, make_tiny_bert, small_trec, tiny_text_classifier


def frozen_transformer_classifier(corpus, bert_dir: Path) -> TextClassifier:
    """A classifier on a frozen tiny BERT: its document embeddings are static, so flair stores them on the
    sentences (``embeddings_storage_mode="cpu"``) and reuses them."""
    torch.manual_seed(3)
    embeddings = TransformerDocumentEmbeddings(str(bert_dir), fine_tune=False)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def _stored_dtypes(corpus) -> set[torch.dtype]:
    return {
        embedding.dtype
        for split in (corpus.train, corpus.dev, corpus.test)
        for sentence in split
        for embedding in sentence._embeddings.values()
    }


@pytest.mark.parametrize(
    "precisions",
    [("bf16-true", "32-true"), ("bf16-true", "64-true"), ("64-true", "bf16-true"), ("32-true", "bf16-true")],
)
def test_a_run_in_one_precision_leaves_the_corpus_usable_in_another(tmp_path: Path, precisions: tuple) -> None:
    """flair stores static embeddings on the corpus' sentences; a run in another precision than 32-true must not
    leave them there in its own dtype, nor read float32 ones back into a bf16/float64 model."""
    corpus = small_trec(train_size=16, dev_size=4, test_size=4)
    bert = make_tiny_bert(tmp_path / "bert", corpus)
    for number, precision in enumerate(precisions):
        model = frozen_transformer_classifier(corpus, bert)
        FabricTrainer(model, corpus).train(
            tmp_path / f"run-{number}",
            max_epochs=1,
            mini_batch_size=8,
            accelerator="cpu",
            devices=1,
            precision=precision,
            embeddings_storage_mode="cpu",
        )
        stored = _stored_dtypes(corpus)
        if precision == "32-true":
            assert stored == {torch.float32}, "32-true keeps flair's behaviour: the embeddings stay stored"
        else:
            assert stored == set(), f"{precision}: no embedding of the run's dtype is left on the caller's sentences"


TRAINS_IN = {
    "32": (torch.float32, torch.float32),
    "32-true": (torch.float32, torch.float32),
    "64": (torch.float64, torch.float64),
    "64-true": (torch.float64, torch.float64),
    "bf16": (torch.bfloat16, torch.float32),  # Fabric's alias of bf16-mixed
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}
"""What a precision name (``str`` of it: 32 and "32" alike) trains in on a CPU: the decoder's compute dtype and the
parameters' dtype (Fabric's documentation of its precision plugins)."""


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS)
def test_every_precision_name_trains_or_is_refused_before_anything_starts(tmp_path: Path, precision) -> None:
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    model = tiny_text_classifier(corpus)
    options = {"max_epochs": 1, "mini_batch_size": 4, "accelerator": "cpu", "devices": 1, "precision": precision}
    if str(precision) in TRAINS_IN:  # README: the precision given, or its alias, is what Fabric trains with
        computes_in, weights_in = TRAINS_IN[str(precision)]
        computed: set[torch.dtype] = set()
        model.decoder.register_forward_hook(
            lambda module, inputs, output: computed.add(output.dtype) if module.training else None
        )
        FabricTrainer(model, corpus).train(tmp_path / "run", **options)
        assert computed == {computes_in}, f"precision={precision!r}: the decoder computed in {computed}"
        assert {parameter.dtype for parameter in model.parameters()} == {weights_in}
        assert all(torch.isfinite(parameter.float()).all() for parameter in model.parameters())
    else:  # CUDA-only precisions on a CPU, and Transformer Engine's
        with pytest.raises(ValueError, match=f"precision={precision!r}"):
            FabricTrainer(model, corpus).train(tmp_path / "run", **options)
        assert not (tmp_path / "run").exists(), "refused before anything was written"
