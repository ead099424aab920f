"""flair-fabric's own training arguments, declared once: their defaults, checks, and the texts of the README's
argument table and of the entry points' docstrings."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_WINDOW = 50
"""Global batches per window, as Hugging Face's ``group_by_length`` (its megabatches of 50 batches)."""

ANNOTATIONS = {
    "global_batch_size": "Optional[int]",
    "devices": "DevicesArgument",
    "strategy": "StrategyArgument",
    "precision": "Optional[str]",
    "collective_timeout": "Union[float, timedelta, None]",
    "progress_bar": "Optional[bool]",
    "checkpoint_every_n_steps": "Optional[int]",
    "checkpoint_every_n_minutes": "Optional[float]",
    "requeue_signal": "Union[signal.Signals, str, None]",
    "resume_from": "Union[str, Path, None]",
    "storage_options": "Optional[Dict[str, Any]]",
    "val_check_interval": "Union[int, float, None]",
}
"""The annotations (as text) of the parameters FabricTrainer adds where the field's type does not say it all;
``Any`` for the others."""


def _about(meaning: str, accepted: str, doc: str) -> dict[str, str]:
    """An option's description: its meaning and accepted values (the README's table), its docstring line."""
    return {"meaning": meaning, "accepted": accepted, "doc": doc}


@dataclass(frozen=True)
class TrainingOptions:
    """flair-fabric's own training arguments, as the caller gave them (checked when the run's arguments are bound).

    Declared once: the signatures of ``train``, ``fine_tune`` and ``train_custom``, their docstring and the README's
    argument table come from these fields (``tests/training/test_arguments.py`` holds the README to them)."""

    global_batch_size: int | None = field(
        default=None,
        metadata=_about(
            "the data points of one optimizer step over all processes, instead of `mini_batch_size` per process:"
            " steps, schedules and results then do not depend on the number of devices (each process reads"
            " `global_batch_size / N`, shares differing by one); a checkpoint records it",
            "`None`, int >= the number of processes",
            "the data points of one optimizer step over all processes, instead of mini_batch_size per process (leave"
            " mini_batch_size out): steps, schedules and results do not depend on the number of devices; None: the"
            " global batch is mini_batch_size times the processes.",
        ),
    )
    group_by_length: bool = field(
        default=False,
        metadata=_about(
            "each epoch's order cut into windows of `group_by_length_window` global batches, each sorted by length"
            " and cut into batches that are shuffled, the longest batch first: little padding (subwords for"
            " transformers); the same on any number of devices; `False`: flair's batches",
            "`True`, `False`",
            "group each epoch's batches by length (HF's name): windows of group_by_length_window global batches"
            " sorted by length, their batches shuffled, the longest first; False: flair's batches.",
        ),
    )
    group_by_length_window: int = field(
        default=DEFAULT_WINDOW,
        metadata=_about(
            "global batches per window of `group_by_length` (as Hugging Face's); larger: less padding, less randomness",
            "int >= 1",
            "global batches per window of group_by_length (50, as Hugging Face's).",
        ),
    )
    progress_bar: bool | None = field(
        default=None,
        metadata=_about(
            "a bar per epoch on global rank 0; `None`: in a terminal or a notebook",
            "`None`, `True`, `False`",
            "a bar per epoch on global rank 0: True, False, or None (in a terminal or a notebook).",
        ),
    )
    checkpoint_every_n_epochs: int = field(
        default=0,
        metadata=_about(
            "save the complete training state to `base_path/checkpoints/` every n epochs",
            "int >= 0",
            "save the complete training state to base_path/checkpoints/ every n epochs (0: never).",
        ),
    )
    checkpoint_every_n_steps: int | None = field(
        default=None,
        metadata=_about(
            "also every n optimizer steps, inside epochs: a resume continues at the next batch",
            "int >= 1",
            "also every n optimizer steps, inside epochs (a resume continues at the next batch).",
        ),
    )
    checkpoint_every_n_minutes: float | None = field(
        default=None,
        metadata=_about(
            "also every n minutes of global rank 0's clock",
            "a positive number",
            "also every n minutes (global rank 0's clock, agreed by all ranks).",
        ),
    )
    keep_checkpoints: int = field(
        default=1,
        metadata=_about(
            "how many of the newest complete checkpoints are kept",
            "int >= 1",
            "how many of the newest complete checkpoints to keep.",
        ),
    )
    requeue_signal: signal.Signals | str | None = field(
        default=signal.SIGUSR1,
        metadata=_about(
            '"preempted": every rank stops, a checkpoint is written, the job is requeued (`scontrol`) or exits with'
            " code 75",
            "a signal, its name, `None`",
            'the signal that means "preempted" (SLURM\'s --signal=USR1@120): every rank stops at the next'
            " agreement point, a checkpoint is written, the job is requeued (scontrol) or exits with code 75. None:"
            " no such signal.",
        ),
    )
    resume_from: str | Path | None = field(
        default=None,
        metadata=_about(
            'continue a run exactly from a checkpoint, also mid-epoch; `"auto"`: the run\'s newest (the default'
            " after a torchrun restart)",
            '`None`, `"auto"`, a checkpoint folder',
            'continue from a checkpoint: its folder, or "auto" for the newest in base_path/checkpoints (the'
            " default when torchrun restarted the job).",
        ),
    )
    storage_options: dict[str, Any] | None = field(
        default=None,
        metadata=_about(
            "a URL `base_path`'s filesystem options (fsspec's: credentials, `endpoint_url`, ...), where the"
            " provider's environment variables or config files do not give them; never written to `config.yaml`,"
            " the model card, a checkpoint, a tracker or a log",
            "`None`, a dict",
            "options of a URL base_path's filesystem (fsspec's: credentials, endpoint_url, ...) where the provider's"
            " environment variables do not give them; never written anywhere (config.yaml, model card, trackers).",
        ),
    )
    save_adapters: bool = field(
        default=False,
        metadata=_about(
            "a model with LoRA adapters (`peft_config`): beside each model file (`best-model.pt`, ...) also its"
            " unmerged adapters, peft's own folder (`best-model.adapter/`, `PeftModel.from_pretrained` loads it);"
            " the model files keep the adapters merged",
            "`True`, `False`",
            "a model with LoRA adapters (peft_config): also write each model file's unmerged adapters beside it, as"
            " peft's own folder (best-model.adapter/ for best-model.pt; PeftModel.from_pretrained loads it); the"
            " model files still hold the adapters merged.",
        ),
    )
    balance_batches: bool = field(
        default=True,
        metadata=_about(
            "several processes with DDP (FSDP and DeepSpeed keep strided shards): each step's data points are dealt"
            " to the ranks so that the rank with the longest sentences gets fewer (the same points per step, the"
            " same gradient up to the order of additions); `False`: strided shards of equal size",
            "`True`, `False`",
            "several processes with DDP: deal each step's data points to the ranks so that the rank with the"
            " longest sentences gets fewer (the same points per step, the same gradient up to the order of"
            " additions); False, and always with FSDP or DeepSpeed: strided shards of equal size.",
        ),
    )

    val_check_interval: int | float | None = field(
        default=None,
        metadata=_about(
            "also evaluate (dev score, `loss.tsv` row, `best-model.pt`, annealing, `after_evaluation`) inside epochs:"
            " an int is every n optimizer steps of an epoch, a float in (0, 1] that fraction of an epoch's steps;"
            " `None`: at epoch ends only, as flair",
            "`None`, int >= 1, float in (0, 1]",
            "also evaluate inside epochs, as at an epoch's end: every n optimizer steps of an epoch (int), or every"
            " fraction of an epoch's steps (float in (0, 1]); None: at epoch ends only, as flair.",
        ),
    )

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in order."""
        return [each.name for each in fields(cls)]

    def check(self) -> None:
        """Refuse options of the wrong kind, naming the argument and the fix (before any process starts)."""
        if not isinstance(self.balance_batches, bool):
            raise ValueError(
                f"balance_batches={self.balance_batches!r} is not valid: pass True (each step dealt by length) or"
                " False (strided shards)."
            )
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(
                f"storage_options must be a dict of the filesystem's options (or None), not"
                f" {type(self.storage_options).__name__}: e.g. storage_options={{'profile': 'training'}}."
            )
        if not isinstance(self.save_adapters, bool):
            raise ValueError(
                f"save_adapters={self.save_adapters!r} is not valid: pass True (each model file's unmerged adapters"
                " also in a folder beside it) or False (the model files only)."
            )
        size = self.global_batch_size
        if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ValueError(
                f"global_batch_size={size!r} is not valid: pass the data points of one optimizer step over all"
                " processes (an int >= 1), or None to give mini_batch_size per process."
            )
        if not isinstance(self.group_by_length, bool):
            raise ValueError(
                f"group_by_length={self.group_by_length!r} is not valid: pass True (batches grouped by length) or"
                " False (flair's batches)."
            )
        window = self.group_by_length_window
        if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
            raise ValueError(
                f"group_by_length_window={window!r} is not valid: pass the global batches per window (an int >= 1;"
                " 50 by default)."
            )
        interval = self.val_check_interval
        valid_int = isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1
        valid_fraction = isinstance(interval, float) and 0.0 < interval <= 1.0
        if interval is not None and not (valid_int or valid_fraction):
            raise ValueError(
                f"val_check_interval={interval!r} is not valid: pass a number of optimizer steps (an int >= 1), a"
                " fraction of an epoch (a float in (0, 1], e.g. 0.25 for four evaluations per epoch), or None to"
                " evaluate at epoch ends only."
            )
