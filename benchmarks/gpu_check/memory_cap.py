"""A run whose batches fit in the GPU's memory only in chunks trains through set-up and steps (issue 34).

The process's CUDA memory is capped (``torch.cuda.set_per_process_memory_fraction``) halfway between what a run in
chunks of 4 and the same run in whole batches of 32 reserve; then the run in chunks must train under the cap and the
run in whole batches must run out of memory (else the cap proves nothing). The several-process set-up passes
(stand-in search, unused-parameter probe) run only with 2+ ranks and stay tested on CPU
(``tests/training/test_every_model.py``); this unit covers the one-GPU path: set-up, steps, evaluation.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .context import Context, guarded, result
from .settings import FAILED, PASSED, Sizes
from .training import build_classifier, fabric_args, fine_tune, trec

NAME = "chunks_under_memory_cap"
BATCH, CHUNK = 32, 4


def _reserved_peak_of_a_run(ctx: Context, base: Path, chunk_size: int | None) -> float:
    """Peak bytes the caching allocator reserved for one short fine-tuning run; raises if it runs out of memory."""
    import torch

    from flair_fabric import FabricTrainer

    sizes = Sizes(train=4 * BATCH, dev=BATCH, test=0, epochs=1, batch=BATCH, learning_rate=5e-5)
    corpus = trec(sizes)
    model = build_classifier(ctx, corpus)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        fine_tune(FabricTrainer(model, corpus), base, sizes, [], mini_batch_chunk_size=chunk_size, **fabric_args(ctx))
        return float(torch.cuda.max_memory_reserved())
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def check_chunks_under_a_memory_cap(ctx: Context) -> dict:
    import torch

    chunked = _reserved_peak_of_a_run(ctx, ctx.work / "chunked", CHUNK)
    whole = _reserved_peak_of_a_run(ctx, ctx.work / "whole", None)
    measured: dict[str, Any] = {"chunked_reserved_mib": chunked / 2**20, "whole_reserved_mib": whole / 2**20}
    if whole <= chunked:
        return result(NAME, FAILED, f"whole batches reserve no more than chunks: {measured}", **measured)
    cap = (chunked + whole) / 2
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    measured["cap_mib"] = cap / 2**20
    try:
        measured["capped_chunked_reserved_mib"] = _reserved_peak_of_a_run(ctx, ctx.work / "capped", CHUNK) / 2**20
        try:
            _reserved_peak_of_a_run(ctx, ctx.work / "capped-whole", None)
            bites = False
        except torch.OutOfMemoryError:
            bites = True
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    measured["whole_batches_run_out_of_memory_under_the_cap"] = bites
    if not bites:
        return result(NAME, FAILED, f"the cap does not bite: whole batches trained under it ({measured})", **measured)
    return result(
        NAME,
        PASSED,
        f"chunks of {CHUNK} train under a cap of {cap / 2**20:.0f} MiB, where batches of {BATCH} run out of memory",
        **measured,
    )


def unit_memory_cap(ctx: Context) -> Iterator[dict]:
    """Training in chunks under a memory cap that whole batches exceed."""
    yield guarded(NAME, lambda: check_chunks_under_a_memory_cap(ctx))
