"""Where a run stands: the one record the training loop reads and writes, and that a checkpoint stores.

Everything a resume needs and everything the loop decides from lives here (litgpt's ``state`` dict, typed): the
progress (epochs, steps, the position in the epoch), the best score, what is due at the epoch's
end, the ranks' pending agreement flags, when the last checkpoint was taken, and, after a resume, where the
interrupted epoch continues. A checkpoint stores the record as JSON (:meth:`RunState.stored`); the fields that only
make sense in the running process (the clock, the resume point read from a checkpoint, the generators, which each
rank stores in its own part) are left out.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class EpochEnd(enum.Enum):
    """What the epoch's end must do besides evaluating, decided at its last step."""

    NOTHING = "nothing"
    CHECKPOINT = "checkpoint"
    """A checkpoint was due at the epoch's last step: it is taken after the evaluation, as the epoch's."""
    PREEMPTED = "preempted"
    """A preemption was agreed at the epoch's last step: checkpoint after the evaluation, then end for a requeue."""


@dataclass
class AgreementFlags:
    """What a rank holds until the ranks next agree (:class:`~flair_fabric.distributed.lockstep.Lockstep`)."""

    stop: str | None = None
    """A plugin's ``TrainingInterrupt`` raised on this rank (its message)."""
    signal: str | None = None
    """Ctrl-C or SIGTERM received by this rank (the signal's name)."""
    checkpoint_requested: bool = False
    """Global rank 0's clock asks for a checkpoint."""
    preemption: str | None = None
    """The preemption signal this rank received."""


@dataclass
class ResumePoint:
    """Where a resumed run continues inside an epoch, and what the run that wrote the checkpoint had of it."""

    step_in_epoch: int
    epoch_position: int
    every_rank: list[dict[str, Any]]
    """Each rank's own part of the checkpoint (its generators, its part of the epoch's loss)."""
    same_processes: bool


@dataclass
class RunState:
    """The one record of a run: what the loop reads and writes, and what a checkpoint stores."""

    epoch: int
    """Completed epochs."""
    batch_count: int
    """Optimizer steps taken (flair's ``batch_count``)."""
    best_epoch_score: float
    """The best dev score so far (or the lowest train loss, without a dev split)."""
    world_size: int
    """The number of processes of the run that wrote it."""
    model_fingerprint: dict[str, str] = field(default_factory=dict)
    """The model's structure and dictionaries, to check that a resume continues the same model."""
    step_in_epoch: int = 0
    """Steps done in the epoch after ``epoch`` (0 at an epoch's end): where a mid-epoch resume continues."""
    epoch_position: int = 0
    """Data points of that epoch's order the ranks have read (to continue on another number of processes)."""
    chunk_size: int | None = None
    """With ``mini_batch_chunk_size="auto"``: the chunk size a step of the current epoch needed after running out of
    memory (``None``: whole mini-batches)."""
    global_batch_size: int = 0
    """The data points of one optimizer step over all ranks (0: a checkpoint of flair-fabric before 2026-12-07)."""
    global_batch_size_given: bool = False
    """Whether the run named ``global_batch_size`` (else it is ``mini_batch_size`` times the processes)."""
    group_by_length_window: int = 0
    """With ``group_by_length``: its window in global batches (0: flair's batches)."""
    ray_run: str = ""
    """The Ray Train run that wrote it (where Ray keeps the run), ``""`` outside Ray: a restart by Ray continues it."""
    epoch_end: EpochEnd = EpochEnd.NOTHING
    """What the current epoch's end must do (decided at its last step)."""
    preempted_by: str | None = None
    """With ``EpochEnd.PREEMPTED``: which signal, received by which rank."""
    flags: AgreementFlags = field(default_factory=AgreementFlags)
    """This rank's flags, held until the ranks next agree."""
    last_checkpoint: float = field(default_factory=time.monotonic, metadata={"stored": False})
    """When this process last wrote a checkpoint (its monotonic clock)."""
    resume: ResumePoint | None = field(default=None, metadata={"stored": False})
    """After a mid-epoch resume, until the epoch's batches are drawn: where the interrupted epoch continues."""
    epoch_start_generators: dict[str, Any] | None = field(default=None, metadata={"stored": False})
    """This rank's random number generators when the current epoch began (they decide the epoch's order in one
    process); stored in the rank's own part of a checkpoint, not in the JSON."""

    def stored(self) -> dict[str, Any]:
        """What a checkpoint stores: every field but the process-local ones, as JSON-ready values."""
        values = {each.name: getattr(self, each.name) for each in fields(self) if each.metadata.get("stored", True)}
        values["epoch_end"] = self.epoch_end.value
        values["flags"] = asdict(self.flags)
        return values

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> RunState:
        """The record :meth:`stored` wrote."""
        values = dict(values)
        if values.pop("seed", 0) and values.get("step_in_epoch") and values.get("world_size", 1) > 1:
            raise ValueError(
                "this checkpoint was written inside an epoch by an older flair-fabric whose ranks drew their own data"
                " order; its epoch cannot be continued exactly: resume from a checkpoint written at an epoch's end"
                " (checkpoint_every_n_epochs), or start the run again"
            )
        values["epoch_end"] = EpochEnd(values.get("epoch_end", EpochEnd.NOTHING.value))
        values["flags"] = AgreementFlags(**values.get("flags", {}))
        return cls(**values)

    def global_batch_changes(self, global_batch_size: int, given: bool) -> str | None:
        """Whether a run with ``global_batch_size`` (``given``: named by the caller) may continue this checkpoint:
        ``None`` where it continues the same steps, a warning where the checkpoint's run and this one both set their
        batch per process and the global batch changes with the number of processes. A run that named
        ``global_batch_size``, or continues one that did, must keep it: else a ``ValueError`` names both values."""
        saved = self.global_batch_size
        if saved in (0, global_batch_size):
            return None
        written = f"global_batch_size={saved}" + (
            "" if self.global_batch_size_given else f" ({self.world_size} process(es) x mini_batch_size)"
        )
        if self.global_batch_size_given or given:
            raise ValueError(
                f"resume_from: the checkpoint was trained with {written}, this run has global_batch_size="
                f"{global_batch_size}: pass global_batch_size={saved} (and leave mini_batch_size out) to continue"
                " the same run, or start a new run."
            )
        return (
            f"the checkpoint was trained with {written} and this run's mini_batch_size gives {global_batch_size}: the"
            f" steps from here on are of another size; pass global_batch_size={saved} to continue the same run."
        )

    def check_same_grouping(self, group_by_length_window: int) -> None:
        """Refuse to continue this checkpoint with other batches by length (``0``: not grouped), naming both."""
        if self.group_by_length_window != group_by_length_window:

            def named(window: int) -> str:
                return f"group_by_length=True, group_by_length_window={window}" if window else "group_by_length=False"

            raise ValueError(
                f"resume_from: the checkpoint was trained with {named(self.group_by_length_window)}, this run has"
                f" {named(group_by_length_window)}: pass the checkpoint's to continue the same run, or start a new run."
            )
