"""What a config run hands to each thing it makes, read from the callables' signatures (the reference for "a run from
``config.yaml`` is the same run"): a class gets the ``init_args`` the config gives and its own defaults for the rest
(its ``**kwargs`` exactly what the config gives); the trainer's method gets the trainer keys, and a
``mini_batch_size`` left out beside ``global_batch_size`` follows from the global batch (``None``, docs/shell.md)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from flair.trainers import ModelTrainer
from jsonargparse import Namespace
from jsonargparse.typing import import_object

from flair_fabric import FabricTrainer
from flair_fabric.shell.options import DictionaryRule

MADE_BY_THE_COMMAND = {"embeddings", "tag_dictionary", "label_dictionary", "corpus"}


def _branches(namespace: Namespace | None) -> dict[str, Any]:
    """A namespace's own keys (a nested class spec stays one value, not dotted keys)."""
    own = vars(namespace) if namespace is not None else {}
    return {key: value for key, value in own.items() if not key.startswith("__")}


def _plain(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Namespace) and "class_path" in value:
        return received(value)
    if isinstance(value, Namespace):
        return {key: _plain(each) for key, each in _branches(value).items()}
    if isinstance(value, dict):
        return {key: _plain(each) for key, each in value.items()}
    if isinstance(value, list):
        return [_plain(each) for each in value]
    return value


def _bound(target: Callable[..., Any], given: dict[str, Any], left_out: set[str]) -> dict[str, Any]:
    """The named arguments ``target`` receives from ``given`` (its own defaults applied), with what its ``**kwargs``
    gets listed by name (a class may pass its ``**kwargs`` on to anything: only the same names are the same call)."""
    bound = inspect.signature(target).bind_partial(**given)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = next((n for n, p in inspect.signature(target).parameters.items() if p.kind == p.VAR_KEYWORD), None)
    if extra is not None:
        arguments.update(arguments.pop(extra, {}))
    return {name: _plain(value) for name, value in arguments.items() if name not in left_out}


def received(spec: Any) -> Any:
    """``(class_path, arguments)`` of a ``class_path``/``init_args`` spec: what the class is called with."""
    if spec is None:
        return None
    target = import_object(spec.class_path)
    init_args = _branches(spec.get("init_args"))
    return spec.class_path, _bound(target, init_args, MADE_BY_THE_COMMAND)


def what_the_run_receives(given: Namespace) -> dict[str, Any]:
    """Per section, what the run's callables receive from ``given`` (a config parsed with ``defaults=False``)."""
    trainer = _branches(given.get("trainer"))
    method = trainer.pop("method", "train")
    trainer.update(trainer.pop("optimizer_kwargs", None) or {})
    if trainer.get("global_batch_size") is not None and "mini_batch_size" not in trainer:
        trainer["mini_batch_size"] = None
    base_path = trainer.pop("base_path")
    arguments = _bound(getattr(FabricTrainer, method), trainer, set())
    arguments.pop("base_path", None)
    for name, parameter in inspect.signature(ModelTrainer.train_custom).parameters.items():
        if parameter.default is not parameter.empty:  # flair's train and fine_tune pass **kwargs to train_custom
            arguments.setdefault(name, _plain(parameter.default))
    return {
        "seed": given.get("seed"),
        "corpus": received(given.get("corpus")),
        "embeddings": received(given.get("embeddings")),
        "model": received(given.get("model")),
        "loggers": [received(each) for each in given.get("loggers") or []],
        "dictionary": _bound(DictionaryRule, _branches(given.get("dictionary")), set()),
        "trainer": (method, os.fspath(base_path), arguments),
    }
