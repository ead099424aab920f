"""The resolved config kept beside the model: written to ``base_path/config.yaml`` by global rank 0, and held
against the config of a resume, which must be the same run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from flair_fabric.plugins.rank_zero import GlobalZeroPlugin
from flair_fabric.shell.errors import ConfigError

CONFIG_FILE = "config.yaml"

MAY_CHANGE_ON_RESUME = ("trainer.max_epochs", "trainer.resume_from", "trainer.devices", "trainer.num_nodes")
"""What a resume may change: more epochs (as flair allows), the checkpoint to continue from, and how many processes
continue the run (a checkpoint continues on another number of devices)."""


def flattened(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"trainer.learning_rate": 0.1, ...}``: nested mappings as dotted keys (lists stay values)."""
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(flattened(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def resolved_config(parser: Any, config: Any, given: Any) -> str:
    """The config as the run uses it, every key with its value (defaults included), as YAML that runs the same run
    again: a ``mini_batch_size`` the config leaves out beside ``global_batch_size`` is ``null`` (it follows from the
    global batch), not flair's default."""
    from flair.trainers import ModelTrainer

    from flair_fabric.training.batch_sizes import mini_batch_size_left_to_global

    config = config.clone()
    trainer_given = dict(given.get("trainer") or {})
    method = getattr(ModelTrainer, config.trainer.method)
    arguments = {**trainer_given, "global_batch_size": config.trainer.global_batch_size}
    if "mini_batch_size" not in trainer_given:
        config.trainer.mini_batch_size = mini_batch_size_left_to_global(method, (), arguments).get(
            "mini_batch_size", config.trainer.mini_batch_size
        )
    return str(parser.dump(config, skip_unset=False))


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The dotted keys whose value differs (or that only one of two flattened configs has), in order."""
    keys = list(old) + [key for key in new if key not in old]
    return [key for key in keys if old.get(key, "<absent>") != new.get(key, "<absent>")]


def _shown(config: dict[str, Any], key: str) -> str:
    return repr(config[key]) if key in config else "<absent>"


def check_resume(base_path: Path, resolved: str) -> None:
    """Refuse a resume whose config differs from the one the run started with, naming the keys that changed."""
    file = base_path / CONFIG_FILE
    if not file.is_file():
        return
    old = flattened(yaml.safe_load(file.read_text(encoding="utf-8")) or {})
    new = flattened(yaml.safe_load(resolved) or {})
    changed = [key for key in changed_keys(old, new) if key not in MAY_CHANGE_ON_RESUME]
    if changed:
        listed = ", ".join(f"{key} ({_shown(old, key)} -> {_shown(new, key)})" for key in changed)
        raise ConfigError(
            f"trainer.resume_from: the run in {base_path} was started from another config ({file}); changed: {listed}."
            f" Undo the changes to continue the run, or give a new trainer.base_path to start another one (a resume"
            f" may change only {', '.join(MAY_CHANGE_ON_RESUME)})."
        )


class ConfigRecordPlugin(GlobalZeroPlugin):
    """Writes the resolved config to ``base_path/config.yaml`` when training starts (global rank 0 only)."""

    def __init__(self, resolved: str) -> None:
        super().__init__()
        self.resolved = resolved

    @GlobalZeroPlugin.hook
    def after_setup(self, base_path: Any = None, **kw: Any) -> None:
        """Write the config (atomically: a resume reads it)."""
        if base_path is None:
            return
        file = Path(base_path) / CONFIG_FILE
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f".{CONFIG_FILE}.{os.getpid()}")
        partial.write_text(self.resolved, encoding="utf-8")
        os.replace(partial, file)
