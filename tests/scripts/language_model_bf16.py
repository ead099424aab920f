"""`python language_model_bf16.py OUT`: train the tiny character LM in float32 on one process (4 columns), then with
bf16-mixed on 2 forked processes (2 columns each), and write OUT/result.json: whether oneDNN reports bfloat16
support, how far bf16 ends from float32 relative to how far training moved the weights, and the validation
perplexities. Run with ONEDNN_MAX_CPU_ISA=AVX2 it behaves as on a CPU without bfloat16 instructions, whatever the
CPU has (oneDNN reads the variable once, when it starts: hence a fresh interpreter). If the bf16 run stops with
oneDNN's refusal of a bfloat16 LSTM (the error flair's own trainer stops with there), result.json holds that error as
``bf16_error`` instead, for the test to fail on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.multiprocessing.spawn import ProcessRaisedException

from flair_fabric import FabricLanguageModelTrainer
from tests.language_model.lm_support import (
    LM_OPTIONS,
    copy_model,
    seeded,
    tiny_corpus,
    tiny_language_model,
    validation_perplexities,
)
from tests.support import state_dict_difference

if __name__ == "__main__":
    out = Path(sys.argv[1])
    corpus = tiny_corpus(out / "corpus")
    reference = tiny_language_model(corpus)
    untrained = copy_model(reference)
    seeded()
    FabricLanguageModelTrainer(reference, corpus).train(
        out / "float32", mini_batch_size=4, devices=1, accelerator="cpu", **LM_OPTIONS
    )
    model = tiny_language_model(corpus)
    seeded()
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    try:
        FabricLanguageModelTrainer(model, corpus).train(
            out / "bf16",
            mini_batch_size=2,
            devices=2,
            strategy="ddp_fork",
            accelerator="cpu",
            precision="bf16-mixed",
            **LM_OPTIONS,
        )
    except ProcessRaisedException as error:
        if "primitive descriptor" not in str(error):
            raise
        (out / "result.json").write_text(json.dumps({"onednn_bf16": onednn_bf16, "bf16_error": str(error)[-2000:]}))
        sys.exit(0)
    result = {
        "onednn_bf16": onednn_bf16,
        "bf16_from_float32": state_dict_difference(reference.state_dict(), model.state_dict()),
        "trained_by": state_dict_difference(untrained.state_dict(), reference.state_dict()),
        "validation_perplexities": validation_perplexities(out / "bf16"),
    }
    (out / "result.json").write_text(json.dumps(result))
