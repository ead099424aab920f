"""``mini_batch_chunk_size="auto"``: a training step that runs out of device memory is redone in smaller chunks, on
every rank together, with the result it has when chunked from the start.

flair's losses are sums, so a mini-batch cut into chunks (flair's ``mini_batch_chunk_size``) gives the gradient of
the whole batch. A step starts with the chunk size in force (each rank's whole batch at the start of each epoch). A
pass that raises an out-of-memory error (:func:`~flair_fabric.evaluation.batches.is_out_of_memory`) ends this rank's
attempt; then the ranks agree, and if any rank ran out of memory every rank throws the attempt away (the gradients,
the embeddings stored on the batch, the cached allocator blocks), puts its random number generators back where the
step began, and redoes the step in chunks of half the size, down to one data point (then the run stops with an error
that names the data point).

Several processes: no collective may be left unmatched when a pass fails, or the other ranks would wait in it for ever
(a DDP bucket all-reduce that a rank failing in its backward pass never joins). So no pass runs DDP's own collectives;
:class:`~flair_fabric.distributed.gradients.OverlappedSum` sums the gradients over the ranks during the last pass in an
order every rank follows, and a rank whose attempt failed sends the rest afterwards. Then the ranks agree on the host
(one all-reduce of a few numbers on a gloo group of their own, while the gradients travel: no device synchronisation),
and only an attempt every rank completed reaches the optimizer. A rank never steps with another rank's partial gradient,
and no rank retries alone. Strategies that gather parameters inside the forward pass (FSDP) cannot do without
collectives in a pass, and are refused before launch.

The chunk size a step needed stays in force for the rest of the epoch (a checkpoint stores it, so a resumed run goes
on with it); global rank 0 logs each retried step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed
from flair.data import DataPoint
from lightning.fabric import Fabric

from flair_fabric.distributed.gradients import OverlappedSum
from flair_fabric.evaluation.batches import is_out_of_memory
from flair_fabric.state.run_state import RunState
from flair_fabric.state.training_state import rng_state, set_rng_state
from flair_fabric.training.arguments import TrainArguments
from flair_fabric.training.participation import chunks_for_every_rank

log = logging.getLogger("flair")

CANNOT_SPLIT = 0
"""The chunk size a rank proposes when one data point alone does not fit."""
WHOLE_BATCH = 2**30
"""The chunk size in force (and proposed) while no step of the epoch ran out of memory: any rank's whole batch, which
may hold more than ``mini_batch_size`` data points where the ranks' batches are balanced by length."""


def release_memory(batch: list[DataPoint], parameters: list[torch.nn.Parameter]) -> None:
    """Drop what a failed attempt left: the gradients, the embeddings stored on the batch's data points and the
    allocator's cached blocks."""
    for parameter in parameters:
        parameter.grad = None
    for data_point in batch:
        data_point.clear_embeddings()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


class ChunksOnOutOfMemory:
    """One rank's part in redoing out-of-memory steps in smaller chunks (see the module doc)."""

    def __init__(
        self,
        fabric: Fabric,
        progress: RunState,
        module: torch.nn.Module,
        mini_batch_size: int,
        timeout: timedelta,
    ) -> None:
        self.fabric, self.progress, self.mini_batch_size = fabric, progress, mini_batch_size
        self.parameters = [parameter for parameter in module.parameters() if parameter.requires_grad]
        """The parameters that learn (their gradients are summed over the ranks, and dropped after a failed
        attempt)."""
        # a gloo group of its own, made by every rank at the same point: the agreement stays on the host
        several = fabric.world_size > 1 and torch.distributed.is_initialized()
        self.group = torch.distributed.new_group(backend="gloo", timeout=timeout) if several else None
        self.gradient_sum = OverlappedSum(self.parameters) if several else None

    @classmethod
    def if_asked(
        cls, fabric: Fabric, progress: RunState, module: torch.nn.Module, arguments: TrainArguments
    ) -> ChunksOnOutOfMemory | None:
        """The run's part in redoing out-of-memory steps with ``mini_batch_chunk_size="auto"``; ``None`` without."""
        if not arguments.chunks_on_out_of_memory:
            return None
        return cls(fabric, progress, module, arguments.flair.mini_batch_size, arguments.collective_timeout)

    def close(self) -> None:
        """The run is over: the gradient sum lets go of the parameters' hooks and its buffers."""
        if self.gradient_sum is not None:
            self.gradient_sum.close()

    def step(self, batch: list, one_pass: Callable[[list, bool], None], where: str) -> None:
        """Run ``one_pass(chunk, first)`` for each chunk of ``batch`` until every rank's passes fit; then every rank
        holds the gradients summed over the ranks. ``where`` (the epoch and step) starts the log line and the
        error."""
        generators = rng_state()
        while True:
            # the chunk size in force: the whole batch (whatever its size on this rank) until a step needed less
            in_force = self.progress.chunk_size or WHOLE_BATCH
            chunks = chunks_for_every_rank(batch, self.progress.chunk_size, len(batch))  # (no rank pads here)
            failed_on = self._attempt(chunks, one_pass)
            learned = self.gradient_sum.send_rest() if self.gradient_sum is not None else []
            proposal = in_force
            if failed_on is not None:
                proposal = CANNOT_SPLIT if len(failed_on) == 1 else math.ceil(len(failed_on) / 2)
            proposals, learned_anywhere, order = self._agree(proposal, learned)  # while the gradients travel
            if self.gradient_sum is not None:
                self.gradient_sum.wait()
            agreed = min(proposals)
            if agreed == in_force:
                if self.gradient_sum is not None:
                    self.gradient_sum.keep_learned(learned_anywhere)
                    if not self.gradient_sum.order_adopted:
                        self.gradient_sum.adopt_order(order)
                return
            failed = [rank for rank, value in enumerate(proposals) if value < in_force]
            if agreed == CANNOT_SPLIT:
                alone = f" ({failed_on[0].unlabeled_identifier[:200]!r})" if failed_on is not None else ""
                raise RuntimeError(
                    f"{where}: one data point alone runs out of memory on rank(s) {failed}{alone}. Shorten or remove"
                    " that data point, or train a smaller model or on a device with more memory."
                )
            release_memory(batch, self.parameters)
            set_rng_state(generators)
            self.progress.chunk_size = agreed
            log.warning(  # (flair's logger is off on the other ranks: global rank 0 tells)
                f"{where}: out of memory on rank(s) {failed}; the step is redone in chunks of {agreed} data"
                f" point(s) ({math.ceil(self.mini_batch_size / agreed)} per mini-batch), kept for the rest of"
                " the epoch"
            )

    def _attempt(self, chunks: list[list], one_pass: Callable[[list, bool], None]) -> list | None:
        """Run the passes of one attempt; the chunk that ran out of memory, or ``None`` if every pass fitted."""
        if self.gradient_sum is not None:
            self.gradient_sum.start_attempt()
        for number, chunk in enumerate(chunks):
            if number == len(chunks) - 1 and self.gradient_sum is not None:
                self.gradient_sum.last_pass()  # its gradients are sent while it runs
            try:
                one_pass(chunk, number == 0)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                return chunk
        return None

    def _agree(self, proposal: int, learned: list[bool]) -> tuple[list[int], list[bool], list[float]]:
        """Every rank's proposed chunk size, per parameter whether any rank has a gradient for it, and (until the
        order is adopted) global rank 0's order of readiness; on the host: one all-reduce on the gloo group, none in
        one process."""
        if self.group is None or self.gradient_sum is None:
            return [proposal], learned, []
        world_size, count = self.fabric.world_size, len(learned)
        with_order = not self.gradient_sum.order_adopted
        values = torch.zeros(world_size + count + (count if with_order else 0), dtype=torch.float64)
        values[self.fabric.global_rank] = proposal
        values[world_size : world_size + count] = torch.tensor(learned, dtype=torch.float64)
        if with_order and self.fabric.global_rank == 0:
            values[world_size + count :] = torch.tensor(self.gradient_sum.readiness_positions(), dtype=torch.float64)
        torch.distributed.all_reduce(values, group=self.group)
        numbers = values.tolist()
        learned_anywhere = [value > 0 for value in numbers[world_size : world_size + count]]
        return [round(value) for value in numbers[:world_size]], learned_anywhere, numbers[world_size + count :]
