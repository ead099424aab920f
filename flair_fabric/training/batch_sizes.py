"""How many data points a step reads: per process (flair's ``mini_batch_size``) or over all processes
(``global_batch_size``), resolved once the number of processes is known, before any process starts."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flair_fabric.state.training_state import PROGRESS, read_progress
from flair_fabric.training.arguments import FlairArguments, TrainArguments


def mini_batch_size_left_to_global(
    flair_method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``kwargs`` for flair's ``flair_method`` (called with ``base_path, *args, **kwargs``): with
    ``global_batch_size``, a ``mini_batch_size`` the caller left out is ``None`` (it follows from the global batch),
    not flair's default."""
    if kwargs.get("global_batch_size") is None or "mini_batch_size" in kwargs:
        return kwargs
    positional = list(inspect.signature(flair_method).parameters)[2 : 2 + len(args)]  # after self and base_path
    return kwargs if "mini_batch_size" in positional else {**kwargs, "mini_batch_size": None}


def resolve_batch_sizes(
    flair: FlairArguments, global_batch_size: int | None, world_size: int
) -> tuple[FlairArguments, int]:
    """flair's arguments with the per-process ``mini_batch_size`` (the largest share of a step), and the global batch
    of every step; a ``mini_batch_size`` that disagrees with ``global_batch_size`` is refused."""
    given = flair.mini_batch_size
    if global_batch_size is None:
        if not (isinstance(given, int) and not isinstance(given, bool) and given >= 1):
            raise ValueError(
                f"mini_batch_size={given!r} is not valid: pass the data points per process and step (an int >= 1),"
                " or global_batch_size for the data points of a step over all processes."
            )
        return flair, given * world_size
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is smaller than the {world_size} processes: every process needs"
            f" a data point per step; pass global_batch_size >= {world_size}, or use fewer devices."
        )
    share = -(-global_batch_size // world_size)
    if given is not None and given != share:
        fewest = global_batch_size // world_size
        shares = f"{share}" if fewest == share else f"{fewest} or {share}"
        raise ValueError(
            f"mini_batch_size={given} disagrees with global_batch_size={global_batch_size}: on {world_size}"
            f" process(es) each reads {shares} data points per step. Leave mini_batch_size out (it follows from"
            f" global_batch_size), or pass mini_batch_size={share}."
        )
    return replace(flair, mini_batch_size=share), global_batch_size


def check_batch_options(arguments: TrainArguments) -> None:
    """Refuse, before any process starts, ``group_by_length`` with a sampler and a checkpoint to resume that was
    trained with another global batch or grouping (checked again in the run, where global rank 0 has the files)."""
    if arguments.group_by_length and arguments.flair.sampler is not None:
        raise ValueError(
            "group_by_length=True with a sampler: the sampler decides the epoch's order, group_by_length would undo"
            " it; pass one of them."
        )
    if arguments.resume_folder is not None and (arguments.resume_folder / PROGRESS).is_file():  # (this machine's)
        saved = read_progress(arguments.resume_folder)
        saved.check_same_grouping(arguments.group_by_length_window if arguments.group_by_length else 0)
        saved.global_batch_changes(arguments.global_batch_size, arguments.global_batch_size_given)
