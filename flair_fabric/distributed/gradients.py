"""DDP's gradient communication for steps that may be thrown away and redone (``mini_batch_chunk_size="auto"``).

Every pass of such a step runs under DDP's ``no_sync`` (:mod:`flair_fabric.training.out_of_memory`), and
:class:`OverlappedSum` sums the gradients over the ranks instead, while the last backward pass still runs (each
gradient as soon as that pass has computed it), so the communication overlaps the computation as DDP's does. The
passes backpropagate each rank's loss as flair computes it (a sum over its data points), so the sum over the ranks is
the gradient of the sum over all ranks' batches: what DDP's average gives for losses scaled by the number of
processes, without a pass over the gradients to scale them.

What DDP cannot do, and this can: leave nothing in flight when a rank's attempt fails part-way. Every rank sends the
parameters in one order they all follow (a parameter is sent once all before it in the order were sent). A rank whose
attempt failed, or whose last pass did not reach some parameters, sends the ones it has not sent yet afterwards
(what it has, or zeros). So when the ranks agree on the attempt, every rank has run the same collectives, and an
attempt that is thrown away costs its communication, never a wait.

The order is first the reverse of the parameters' order; from the first step on it is global rank 0's order of
readiness in that step (DDP rebuilds its buckets in the same way), so that a parameter no pass reaches (BERT's
pooler) does not hold the others back. Consecutive small gradients (biases, norms) travel together in one
all-reduce: each is copied into one buffer as soon as it is computed, and then is a view of it (DDP's
``gradient_as_bucket_view``). A parameter that got no gradient on any rank keeps none, as with DDP.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed
from torch.utils.hooks import RemovableHandle

FIRST_BUCKET_BYTES, BUCKET_BYTES = 2**20, 25 * 2**20
"""DDP's bucket sizes: consecutive gradients travel together in one all-reduce, in one buffer, up to 25 MB (the
first bucket 1 MB, so that communication starts early); a larger gradient is all-reduced where it lies."""


class OverlappedSum:
    """Sums the gradients of ``parameters`` over the ranks during the last backward pass of each attempt."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = parameters
        self._set_order(list(reversed(range(len(parameters)))))
        self.order_adopted = False
        self._start(armed=False)
        self._hooks: list[RemovableHandle] = [
            parameter.register_post_accumulate_grad_hook(partial(self._computed, index))
            for index, parameter in enumerate(parameters)
        ]

    def _set_order(self, order: list[int]) -> None:
        """Send in ``order``, in DDP's buckets: consecutive gradients together up to the bucket size."""
        self.groups: list[list[int]] = []
        size = 0
        for index in order:
            parameter = self.parameters[index]
            bytes_ = parameter.numel() * parameter.element_size()
            cap = FIRST_BUCKET_BYTES if len(self.groups) <= 1 else BUCKET_BYTES
            last = self.groups[-1] if self.groups else None
            if last is not None and size + bytes_ <= cap and self.parameters[last[0]].dtype == parameter.dtype:
                last.append(index)
                size += bytes_
            else:
                self.groups.append([index])
                size = bytes_
        self.group_of = [0] * len(self.parameters)
        for number, group in enumerate(self.groups):
            for index in group:
                self.group_of[index] = number
        # per bucket of several gradients, one buffer kept from step to step, and each gradient's view of it
        self.buffers: dict[int, torch.Tensor] = {}
        self.views: list[torch.Tensor | None] = [None] * len(self.parameters)
        for number, group in enumerate(self.groups):
            if len(group) > 1:
                buffer = self.parameters[group[0]].new_empty(sum(self.parameters[index].numel() for index in group))
                parts = buffer.split([self.parameters[index].numel() for index in group])
                for index, part in zip(group, parts, strict=True):
                    self.views[index] = part.view_as(self.parameters[index])
                self.buffers[number] = buffer

    def _start(self, armed: bool) -> None:
        self.armed, self.ready, self.sent_up_to = armed, [False] * len(self.parameters), 0
        self.remaining = [len(group) for group in self.groups]  # per bucket, its gradients not yet computed
        self.touched = [False] * len(self.parameters)  # per parameter, whether a pass of this attempt reached it
        self.readiness: list[int] = []  # this attempt's order of readiness in its last pass
        self.works: list[torch.distributed.Work] = []

    def start_attempt(self) -> None:
        """A new attempt: nothing sent yet."""
        self._start(armed=False)

    def last_pass(self) -> None:
        """The attempt's next pass is its last: send each gradient as soon as that pass computed it."""
        self.armed = True

    def _computed(self, index: int, parameter: torch.nn.Parameter) -> None:
        self.touched[index] = True
        if not self.armed or self.ready[index]:
            return
        self.ready[index] = True
        if not self.order_adopted:
            self.readiness.append(index)
        self._into_buffer(index)
        number = self.group_of[index]
        self.remaining[number] -= 1
        while self.sent_up_to < len(self.groups) and self.remaining[self.sent_up_to] == 0:
            self._send(self.sent_up_to)

    def _into_buffer(self, index: int) -> None:
        """Make the gradient of parameter ``index`` its view of its bucket's buffer (zeros where it has none)."""
        parameter, view = self.parameters[index], self.views[index]
        if view is None or parameter.grad is view:
            return
        if parameter.grad is None:
            view.zero_()
        else:
            view.copy_(parameter.grad)
        parameter.grad = view

    def _send(self, number: int) -> None:
        group = self.groups[number]
        flat = self.buffers.get(number)
        if flat is None:  # one gradient alone: all-reduced where it lies
            parameter = self.parameters[group[0]]
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            flat = parameter.grad
        else:
            for index in group:  # (the last pass did not reach every parameter of the bucket, or did not run)
                self._into_buffer(index)
        self.works.append(torch.distributed.all_reduce(flat, async_op=True))
        self.sent_up_to += 1

    def send_rest(self) -> list[bool]:
        """After the attempt's passes (whether they fitted or not): send what was not sent; returns, per parameter,
        whether a pass of this rank reached it."""
        self.armed = False
        learned = list(self.touched)
        while self.sent_up_to < len(self.groups):
            self._send(self.sent_up_to)
        return learned

    def wait(self) -> None:
        """Wait until every all-reduce of the attempt is done: then each gradient is the sum over the ranks."""
        for work in self.works:
            work.wait()
        self.works = []

    def readiness_positions(self) -> list[float]:
        """Per parameter, its place (from 1) in this rank's order of readiness in the last attempt; 0 if it was not
        reached. Global rank 0's become everyone's order (:meth:`adopt_order`)."""
        positions = [0.0] * len(self.parameters)
        for place, index in enumerate(self.readiness, start=1):
            positions[index] = float(place)
        return positions

    def adopt_order(self, positions: list[float]) -> None:
        """Send in the order ``positions`` gives (global rank 0's readiness), the parameters it did not reach last."""
        reached = sorted((place, index) for index, place in enumerate(positions) if place > 0)
        first = [index for _, index in reached]
        self._set_order(first + [index for index in reversed(range(len(self.parameters))) if positions[index] == 0])
        self.order_adopted = True

    def keep_learned(self, learned_anywhere: list[bool]) -> None:
        """A parameter that no rank has a gradient for keeps none (it was sent as zeros)."""
        for parameter, learned in zip(self.parameters, learned_anywhere, strict=True):
            if not learned:
                parameter.grad = None

    def close(self) -> None:
        """Remove the gradient hooks and let go of the buffers (the run is over; the gradients stay as they are)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.buffers, self.views = [], {}, [None] * len(self.parameters)
