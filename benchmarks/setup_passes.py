"""What the set-up passes flair-fabric adds on several processes cost, against one training step (issue 34).

Before training, every rank of a run on 2+ processes searches a *stand-in batch* (forward passes without backward,
``training/participation.py``) and, under DDP with ``find_unused_parameters="auto"``, probes the model once (one
forward and backward pass, ``strategies/probing.py``). Each pass holds at most one chunk of a training step
(``mini_batch_chunk_size``), so a run whose batches fit only in chunks also fits through its set-up.

Measured on all-MiniLM-L6-v2 fine-tuned on TREC questions, ``mini_batch_size=32, mini_batch_chunk_size=4``:

- ``training_step``: one step as the trainer runs it: 8 chunks, forward and backward each, then the optimizer step;
- ``stand_in_search`` and ``unused_parameter_probe``: the set-up passes, at one chunk;
- ``..._whole_batch``: the same passes on a whole mini-batch (what set-up did before issue 34).

Each measurement runs in a fresh process after one warm-up training step; time is the median of 3 repetitions.
Memory is the activation memory of the largest pass: the bytes the forward pass keeps for the backward pass
(counted through ``torch.autograd.graph.saved_tensors_hooks``, each tensor once, parameters left out). That is the
part of a pass's memory that grows with its data points; the parameters, their gradients and the optimizer state
are the same for every pass (a resident-size measurement on CPU hides it behind the allocator's reuse of freed
memory).

    python benchmarks/setup_passes.py        # results in benchmarks/results/setup_passes.{json,md}
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from common import build_model, machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BATCH, CHUNK = 32, 4
MODES = (
    "training_step",
    "stand_in_search",
    "unused_parameter_probe",
    "stand_in_search_whole_batch",
    "unused_parameter_probe_whole_batch",
)


class SavedForBackward:
    """The bytes the forward passes keep for their backward pass (parameters left out: they are held anyway): the
    largest over the passes it watched."""

    def __init__(self, parameters: Any) -> None:
        self.parameters = {parameter.untyped_storage().data_ptr() for parameter in parameters}
        self.current: dict[tuple[int, int], int] = {}
        self.largest = 0

    def pack(self, tensor: Any) -> Any:
        if tensor.untyped_storage().data_ptr() not in self.parameters:
            self.current[(tensor.untyped_storage().data_ptr(), tensor.storage_offset())] = tensor.nbytes
        return tensor

    def pass_ended(self) -> None:
        self.largest = max(self.largest, sum(self.current.values()))
        self.current.clear()


def _measure(mode: str) -> dict[str, Any]:
    """In this process: the model, a warm-up step, then ``mode`` three times; seconds and activation memory."""
    import torch
    from flair.training_utils import store_embeddings

    from flair_fabric.datasets import trec_corpus
    from flair_fabric.strategies.probing import parameters_without_gradient
    from flair_fabric.training.participation import find_stand_in_batch, largest_pass

    torch.set_num_threads(1)
    corpus = trec_corpus(train_size=4 * BATCH, dev_size=0, test_size=0, seed=42)
    model = build_model("minilm", corpus)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    batch = [corpus.train[i] for i in range(BATCH)]

    def training_step() -> None:
        optimizer.zero_grad()
        for start in range(0, BATCH, CHUNK):
            chunk = batch[start : start + CHUNK]
            loss, _ = model.forward_loss(chunk)
            loss.backward()
            store_embeddings(chunk, "none")  # as the trainer does after each pass
        optimizer.step()

    pass_size = largest_pass(BATCH, CHUNK) if not mode.endswith("whole_batch") else BATCH
    work = {
        "training_step": training_step,
        "stand_in_search": lambda: find_stand_in_batch(model, corpus.train, pass_size, 8 * BATCH),
        "unused_parameter_probe": lambda: parameters_without_gradient(model, batch[:pass_size]),
    }[mode.removesuffix("_whole_batch")]
    model.train()
    training_step()  # warm-up: first-call allocations, the optimizer's state
    saved = SavedForBackward(model.parameters())
    forward_loss = type(model).forward_loss

    def watched_forward_loss(self: Any, points: list) -> Any:
        saved.pass_ended()  # the previous pass's graph is gone
        return forward_loss(self, points)

    model.forward_loss = types.MethodType(watched_forward_loss, model)
    seconds = []
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        for _ in range(3):
            started = time.perf_counter()
            work()
            seconds.append(time.perf_counter() - started)
    saved.pass_ended()
    return {"mode": mode, "seconds": statistics.median(seconds), "activation_mib": saved.largest / 2**20}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--mode":
        print(json.dumps(_measure(sys.argv[2])))
        return
    rows = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        print(rows[-1], flush=True)
    step = rows[0]
    for row in rows:
        row["time_vs_step"] = round(row["seconds"] / step["seconds"], 3)
        row["memory_vs_step"] = round(row["activation_mib"] / step["activation_mib"], 3)
    RESULTS.mkdir(exist_ok=True)
    result = {"mini_batch_size": BATCH, "mini_batch_chunk_size": CHUNK, "model": "minilm", "rows": rows}
    result["machine"] = machine()
    (RESULTS / "setup_passes.json").write_text(json.dumps(result, indent=2) + "\n")
    table = [
        f"# Set-up passes against one training step (MiniLM, mini_batch_size={BATCH}, mini_batch_chunk_size={CHUNK})",
        "",
        "| work | seconds | x step | activation memory of the largest pass (MiB) | x step |",
        "|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['seconds']:.3f} | {r['time_vs_step']} | {r['activation_mib']:.1f} | "
            f"{r['memory_vs_step']} |"
            for r in rows
        ),
    ]
    (RESULTS / "setup_passes.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
