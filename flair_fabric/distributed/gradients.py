"""DDP's gradient average for steps that may be thrown away and redone (``mini_batch_chunk_size="auto"``).

Every pass of such a step runs under DDP's ``no_sync`` (:mod:`flair_fabric.training.out_of_memory`), and
:class:`OverlappedAverage` averages the gradients instead, as DDP's reducer does: each gradient is divided by the
number of processes and summed over them, and it is sent while the last backward pass still runs (as soon as that
pass has computed it), so the communication overlaps the computation.

What DDP cannot do, and this can: leave nothing in flight when a rank's attempt fails part-way. Every rank sends the
parameters in one order they all follow (a parameter is sent once all before it in the order were sent). A rank whose
attempt failed, or whose last pass did not reach some parameters, sends the ones it has not sent yet afterwards
(what it has, or zeros). So when the ranks agree on the attempt, every rank has run the same collectives, and an
attempt that is thrown away costs its communication, never a wait.

The order is first the reverse of the parameters' order; from the first step on it is global rank 0's order of
readiness in that step (DDP rebuilds its buckets in the same way), so that a parameter no pass reaches (BERT's
pooler) does not hold the others back. Consecutive small gradients (biases, norms) travel together in one
all-reduce. A parameter that got no gradient on any rank keeps none, as with DDP.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed

FIRST_BUCKET_BYTES, BUCKET_BYTES = 2**20, 25 * 2**20
"""DDP's bucket sizes: consecutive gradients travel together in one all-reduce, copied into one buffer, up to 25 MB
(the first bucket 1 MB, so that communication starts early); a larger gradient is all-reduced where it lies."""


def _shares_memory(gradient: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``gradient`` is a view of ``buffer`` (a gradient of the last step that nobody reset)."""
    return gradient.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class OverlappedAverage:
    """Averages the gradients of ``parameters`` over the ranks during the last backward pass of each attempt."""

    def __init__(self, parameters: list[torch.nn.Parameter], world_size: int) -> None:
        self.parameters, self.world_size = parameters, world_size
        self._set_order(list(reversed(range(len(parameters)))))
        self.order_adopted = False
        self._start(armed=False)
        self._hooks = [
            parameter.register_post_accumulate_grad_hook(partial(self._computed, index))
            for index, parameter in enumerate(parameters)
        ]

    def _set_order(self, order: list[int]) -> None:
        """Send in ``order``, in DDP's buckets: consecutive gradients together up to the bucket size."""
        self.order = order
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
        self.buffers: dict[int, torch.Tensor] = {}  # per bucket of several gradients, reused from step to step

    def _start(self, armed: bool) -> None:
        self.armed, self.ready, self.sent_up_to = armed, [False] * len(self.parameters), 0
        self.readiness: list[int] = []  # this attempt's order of readiness in its last pass
        self.works: list[tuple[torch.distributed.Work, torch.Tensor | None, list[int]]] = []

    def start_attempt(self) -> None:
        """A new attempt: nothing sent yet."""
        self._start(armed=False)

    def last_pass(self) -> None:
        """The attempt's next pass is its last: send each gradient as soon as that pass computed it."""
        self.armed = True

    def _computed(self, index: int, parameter: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        self.ready[index] = True
        self.readiness.append(index)
        while self.sent_up_to < len(self.groups) and all(self.ready[i] for i in self.groups[self.sent_up_to]):
            self._send(self.groups[self.sent_up_to])

    def _send(self, group: list[int]) -> None:
        gradients = []
        for index in group:
            parameter = self.parameters[index]
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            gradients.append(parameter.grad)
        if len(group) == 1:
            flat = gradients[0]
        else:
            number = self.sent_up_to
            buffer = self.buffers.get(number)
            if buffer is None or any(_shares_memory(gradient, buffer) for gradient in gradients):
                self.buffers[number] = gradients[0].new_empty(sum(gradient.numel() for gradient in gradients))
            flat = torch.cat([gradient.reshape(-1) for gradient in gradients], out=self.buffers[number])
        flat.div_(self.world_size)
        work = torch.distributed.all_reduce(flat, async_op=True)
        self.works.append((work, flat if len(group) > 1 else None, group))
        self.sent_up_to += 1

    def finish(self) -> list[bool]:
        """After the attempt's passes (whether they fitted or not): send what was not sent, wait for every
        all-reduce; returns, per parameter, whether this rank had a gradient for it."""
        self.armed = False
        learned = [parameter.grad is not None for parameter in self.parameters]
        while self.sent_up_to < len(self.groups):
            self._send(self.groups[self.sent_up_to])
        for work, flat, group in self.works:
            work.wait()
            if flat is not None:  # copied into one buffer: the gradients become views of it (no copy back)
                parts = flat.split([self.parameters[index].numel() for index in group])
                for index, part in zip(group, parts, strict=True):
                    self.parameters[index].grad = part.view_as(self.parameters[index])
        self.works = []
        return learned

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
