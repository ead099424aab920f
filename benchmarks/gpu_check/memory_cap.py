"""A run whose batches fit in the GPU's memory only in chunks trains through set-up and steps (issue 34), and with
``mini_batch_chunk_size="auto"`` a real out-of-memory error is caught and the step redone in chunks (issue 32).

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
AUTO_NAME = "auto_chunks_under_memory_cap"
_FOUND: dict[str, float] = {}
BATCH, CHUNK = 32, 4


def _reserved_peak_of_a_run(
    ctx: Context, base: Path, chunk_size: int | str | None, weights: dict[str, Any] | None = None
) -> float:
    """Peak bytes the caching allocator reserved for one short fine-tuning run; raises if it runs out of memory.
    ``weights`` gets the trained weights (on the CPU)."""
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
        if weights is not None:
            weights.update({key: value.detach().cpu() for key, value in model.state_dict().items()})
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
    _FOUND["cap"] = cap  # for the "auto" check that follows
    return result(
        NAME,
        PASSED,
        f"chunks of {CHUNK} train under a cap of {cap / 2**20:.0f} MiB, where batches of {BATCH} run out of memory",
        **measured,
    )


def check_auto_chunks_under_a_memory_cap(ctx: Context) -> dict:
    """Under the cap whole batches exceed, ``mini_batch_chunk_size="auto"`` catches the real out-of-memory error,
    redoes the step in chunks (logged) and ends as the run chunked from the start with the size it settled on."""
    import logging

    import torch

    cap = _FOUND.get("cap")
    if cap is None:
        return result(AUTO_NAME, FAILED, "no memory cap was found (chunks_under_memory_cap did not pass)")
    retries: list[str] = []

    class Retries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "the step is redone in chunks of" in record.getMessage():
                retries.append(record.getMessage())

    handler = Retries()
    logging.getLogger("flair").addHandler(handler)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    auto: dict[str, Any] = {}
    try:
        measured: dict[str, Any] = {"cap_mib": cap / 2**20}
        measured["auto_reserved_mib"] = _reserved_peak_of_a_run(ctx, ctx.work / "auto", "auto", auto) / 2**20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        logging.getLogger("flair").removeHandler(handler)
    measured["retries"] = retries
    if not retries:
        return result(AUTO_NAME, FAILED, f"no step ran out of memory under the cap: {measured}", **measured)
    settled = int(retries[-1].split("the step is redone in chunks of ")[1].split()[0])
    reference: dict[str, Any] = {}
    _reserved_peak_of_a_run(ctx, ctx.work / "settled", settled, reference)
    difference = max((auto[key].float() - reference[key].float()).abs().max().item() for key in reference)
    measured.update(settled_chunk_size=settled, max_weight_difference=difference)
    if difference > 1e-5:
        failure = f"weights differ from chunks of {settled} from the start: {measured}"
        return result(AUTO_NAME, FAILED, failure, **measured)
    return result(
        AUTO_NAME,
        PASSED,
        f"real out-of-memory errors redone in chunks ({len(retries)} retries, settled on {settled}); weights within"
        f" {difference:.1e} of chunks of {settled} from the start",
        **measured,
    )


def unit_memory_cap(ctx: Context) -> Iterator[dict]:
    """Training in chunks, and with ``mini_batch_chunk_size="auto"``, under a memory cap that whole batches exceed."""
    yield guarded(NAME, lambda: check_chunks_under_a_memory_cap(ctx))
    yield guarded(AUTO_NAME, lambda: check_auto_chunks_under_a_memory_cap(ctx))
