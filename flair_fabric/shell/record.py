"""The resolved config kept beside the model: written to ``base_path/config.yaml`` by global rank 0, and held
against the config of a resume, which must be the same run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace
from jsonargparse.typing import import_object

from flair_fabric.plugins.rank_zero import GlobalZeroPlugin
from flair_fabric.shell.errors import ConfigError
from flair_fabric.shell.signatures import own_parameters
from flair_fabric.storage import is_url, read_text, storage_error

CONFIG_FILE = "config.yaml"
SECRET_KEY = "storage_options"
"""The key whose values (a filesystem's credentials) no written, printed or logged config holds."""

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


def _own_keys(namespace: Any) -> list[str]:
    return [key for key in vars(namespace) if not key.startswith("__")]


def _is_class_spec(value: Any) -> bool:
    return isinstance(value, Namespace) and isinstance(value.get("class_path"), str)


def _without_kwargs_not_given(spec: Any, given: Any) -> None:
    """Drop from a class spec's ``init_args`` the arguments only its ``**kwargs`` would take (jsonargparse lists an
    ancestor's) where the config did not give them: the class may pass its ``**kwargs`` on elsewhere (flair's
    transformer embeddings to ``transformers``), so writing them out would make another call. Nested specs too."""
    init_args = spec.get("init_args")
    if not isinstance(init_args, Namespace):
        return
    same_class = _is_class_spec(given) and given.class_path == spec.class_path
    given_args = given.get("init_args") if same_class else None
    given_args = given_args if isinstance(given_args, Namespace) else Namespace()
    named = own_parameters(import_object(spec.class_path))
    for key in _own_keys(init_args):
        if key not in named and key not in _own_keys(given_args):
            del init_args[key]
        else:
            _without_unrequested(init_args[key], given_args.get(key))


def _without_unrequested(value: Any, given: Any) -> None:
    """:func:`_without_kwargs_not_given` for every class spec in ``value`` (a spec, a list of specs)."""
    if _is_class_spec(value):
        _without_kwargs_not_given(value, given)
    elif isinstance(value, list):
        given_items = given if isinstance(given, list) and len(given) == len(value) else [None] * len(value)
        for item, given_item in zip(value, given_items, strict=True):
            _without_unrequested(item, given_item)


def resolved_config(parser: Any, config: Any, given: Any) -> str:
    """The config as the run uses it, as YAML that runs the same run again: every key with its value, defaults
    included, but for every ``storage_options`` (credentials: ``null``; a run from the YAML takes them from the
    provider's environment variables or is given them again) and the arguments only a class's ``**kwargs`` would
    take, written where the config gives them; a ``mini_batch_size`` the config leaves out beside
    ``global_batch_size`` is ``null`` (it follows from the global batch), not flair's default."""
    from flair.trainers import ModelTrainer

    from flair_fabric.training.batch_sizes import mini_batch_size_left_to_global

    config = config.clone()
    keys = config.keys()  # a Namespace's dotted keys (it has no iterator)
    for key in [key for key in keys if key.rsplit(".", 1)[-1] == SECRET_KEY]:
        config[key] = None  # credentials: never written, printed or logged
    for section in ("corpus", "embeddings", "model", "loggers"):
        _without_unrequested(config.get(section), given.get(section))
    _without_unrequested(config.trainer.get("plugins"), (given.get("trainer") or Namespace()).get("plugins"))
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


def check_resume(base_path: str | Path, resolved: str, storage_options: dict[str, Any] | None = None) -> None:
    """Refuse a resume whose config differs from the one the run started with, naming the keys that changed
    (``base_path`` a folder or a URL, reached with ``storage_options``)."""
    file = f"{str(base_path).rstrip('/')}/{CONFIG_FILE}" if is_url(base_path) else Path(base_path) / CONFIG_FILE
    try:
        text = read_text(file, storage_options)
    except FileNotFoundError:
        return
    except Exception as error:  # the store's own errors (no credentials, denied) as one line naming the file
        unreadable = storage_error(str(file), "trainer.base_path", error, storage_options)
        raise ConfigError(f"trainer.resume_from: {unreadable}") from None
    old = flattened(yaml.safe_load(text) or {})
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
