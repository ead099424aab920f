"""The config's keys and types, declared from the signatures that exist: flair's training methods (read from flair's
source), :class:`~flair_fabric.launch.arguments.LightningArguments` and :class:`~flair_fabric.training.options.
TrainingOptions`. Nothing here imports torch or flair, so ``--help`` and a wrong trainer key answer at once.

A type that names a torch or flair class (``optimizer``, ``plugins``, ``sampler``) is checked in the second pass
(:mod:`~flair_fabric.shell.components`), with flair's own annotation.
"""

from __future__ import annotations

import signal
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionConfigFile, ArgumentParser

from flair_fabric.launch.arguments import LightningArguments
from flair_fabric.shell import values
from flair_fabric.shell.flair_signature import METHODS, NO_DEFAULT, FlairParameter, method_parameters
from flair_fabric.shell.ray_submit import RayOptions
from flair_fabric.training.options import ANNOTATIONS, TrainingOptions

_UNCHECKED = str | dict[str, Any] | list[str | dict[str, Any]] | None
"""A value the first pass does not look into (``Any`` would import a ``class_path`` it holds)."""

CLASS_SECTIONS = ("corpus", "embeddings", "model")
"""The sections that name a class by ``class_path`` and its arguments by ``init_args``."""

DEFAULT_METHOD = "train"
PROG = "python -m flair_fabric train"


class _NeedsImportMeta(type):
    def __getattr__(cls, name: str) -> Any:
        return _NeedsImport  # torch.optim.SGD too


class _NeedsImport(metaclass=_NeedsImportMeta):
    """Stands for a name that only torch or flair defines (its type is checked in the second pass)."""


class _Names(dict):
    def __missing__(self, name: str) -> Any:
        return _NeedsImport


_KNOWN = {name: getattr(typing, name) for name in ("Any", "Optional", "Union", "Literal", "List", "Dict", "Tuple")}
_KNOWN.update({"Path": Path, "timedelta": timedelta, "signal": signal, "list": list, "dict": dict, "tuple": tuple})
_KNOWN.update({"str": str, "int": int, "float": float, "bool": bool, "type": type, "None": None})


def light_type(annotation: str) -> Any:
    """The type an annotation (as text) stands for, or ``Any`` where it needs torch or flair."""
    try:
        value = eval(annotation, {"__builtins__": {}}, _Names(_KNOWN))  # flair's and our annotations only
    except (SyntaxError, TypeError, AttributeError):
        return Any
    return Any if "_NeedsImport" in repr(value) or value is _NeedsImport else value


@dataclass(frozen=True)
class TrainerKey:
    """One key of the config's ``trainer`` section."""

    name: str
    annotation: str
    default: Any
    help: str
    needs_import: bool


def trainer_keys(method: str) -> list[TrainerKey]:
    """The ``trainer`` keys for ``method``: flair's parameters with its defaults, Lightning's, flair-fabric's."""
    keys = [_flair_key(each) for each in method_parameters(method).values()]
    for record, doc in ((LightningArguments, "cli"), (TrainingOptions, "doc")):
        for each in fields(record):
            annotation = ANNOTATIONS.get(each.name, str(each.type))
            default = each.default if each.default is not MISSING else None
            keys.append(TrainerKey(each.name, annotation, default, each.metadata[doc], False))
    return keys


FOLLOWS_FROM_GLOBAL_BATCH = "mini_batch_size"
"""The flair key that may be ``null``: with ``trainer.global_batch_size`` it follows from the global batch (what
``FabricTrainer`` does where a script leaves it out), and the resolved config says so."""


def _flair_key(parameter: FlairParameter) -> TrainerKey:
    needs_import = light_type(parameter.annotation) is Any and parameter.annotation != "Any"
    default = None if parameter.default is NO_DEFAULT else parameter.default
    about = parameter.doc or "flair's argument"
    if parameter.name == FOLLOWS_FROM_GLOBAL_BATCH:
        about += " (null: it follows from trainer.global_batch_size)"
        return TrainerKey(parameter.name, f"Optional[{parameter.annotation}]", default, about, needs_import)
    if needs_import:
        about += f" (flair's type: {parameter.annotation}; an import path, or class_path and init_args)"
    return TrainerKey(parameter.name, parameter.annotation, default, about, needs_import)


@dataclass(frozen=True)
class DictionaryRule:
    """How the model's label dictionary is made from the corpus: ``corpus.make_label_dictionary(label_type,
    min_count, add_unk, add_dev_test)``."""

    label_type: str | None = None
    """The label type to collect; ``None``: the model's ``tag_type`` or ``label_type``."""
    add_unk: bool = False
    """Add ``<unk>`` for labels not seen in training (flair's tutorials: ``False``)."""
    min_count: int = -1
    """Labels seen fewer times become ``<unk>`` (-1: keep every label)."""
    add_dev_test: bool = False
    """Also collect the dev and test splits' labels."""


def method_given(argv: Sequence[str]) -> str:
    """``trainer.method`` as the command line or the config files give it (the last one wins), before parsing: the
    trainer's defaults depend on it."""
    import yaml

    from flair_fabric.shell.errors import config_text

    method = DEFAULT_METHOD
    for index, argument in enumerate(argv):
        if argument == "--config" and index + 1 < len(argv):
            try:
                loaded = yaml.safe_load(config_text(argv[index + 1]))
            except (OSError, ValueError, yaml.YAMLError):
                continue  # the parser reports it, with the file and line
            trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
            if isinstance(trainer, dict) and trainer.get("method") in METHODS:
                method = trainer["method"]
        elif argument.startswith("--trainer.method"):
            value = argument.partition("=")[2] or (argv[index + 1] if index + 1 < len(argv) else "")
            method = value if value in METHODS else method
    return method


def make_parser(method: str, *, class_types: dict[str, Any] | None = None) -> ArgumentParser:
    """The config's parser. Without ``class_types`` (the first pass) the class sections are plain mappings and the
    trainer keys that name a torch or flair class take any value; the second pass hands the classes in."""
    parser = ArgumentParser(
        prog=PROG,
        description="Train a flair model from a YAML config (several files: later ones override earlier ones).",
        epilog=f"The trainer's defaults shown are those of trainer.method={method}; add --trainer.method fine_tune"
        " for fine_tune's. --print_config prints the resolved config (what base_path/config.yaml will hold) and ends;"
        " --<section>.help CLASS lists a class's arguments.",
        exit_on_error=False,
        allow_abbrev=False,
        env_prefix=False,
        default_env=False,
        print_config=None,  # the command prints the resolved config itself (shell.command)
        parser_mode=values.MODE,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config file (also: the first arguments)")
    parser.add_argument("--seed", type=int | None, default=None, help="flair.set_seed(seed) before anything is made")
    for section in CLASS_SECTIONS:
        about = f"the {section}: class_path (an importable class) and init_args"
        if class_types is None:
            parser.add_argument(f"--{section}", type=dict[str, Any] | None, default=None, help=about)
        else:
            class_types[section](parser, section)
    parser.add_class_arguments(DictionaryRule, "dictionary", help="the label dictionary made from the corpus")
    parser.add_argument(
        "--engine", type=Literal["local", "ray"], default="local", help="local: train here; ray: submit"
    )
    parser.add_class_arguments(RayOptions, "ray", help="engine: ray: the Ray cluster and Ray Train's configs")
    loggers_type = class_types["loggers"] if class_types is not None else list[dict[str, Any]]
    parser.add_argument("--loggers", type=loggers_type, default=[], help="Lightning loggers or flair-fabric trackers")
    parser.add_argument(
        "--trainer.method", type=Literal["train", "fine_tune", "train_custom"], default=method, help="flair's method"
    )
    for key in trainer_keys(method):
        key_type, default = (_UNCHECKED if key.needs_import else light_type(key.annotation)), key.default
        if key.needs_import and class_types is not None:
            key_type, default = class_types["trainer"][key.name]
        required = key.name == "base_path"
        if required:  # as written: a URL read as a Path would lose its "//" (s3://bucket/run -> s3:/bucket/run)
            key_type = str
        parser.add_argument(
            f"--trainer.{key.name}",
            type=key_type,
            default=None if required else default,
            required=required,
            help=key.help,
        )
    parser.add_argument(
        "--trainer.optimizer_kwargs", type=dict[str, Any], default={}, help="further arguments of the optimizer"
    )
    return parser


def config_argv(argv: Sequence[str]) -> list[str]:
    """``train a.yaml b.yaml --x y`` as jsonargparse reads it: each leading file as ``--config FILE``."""
    args = list(argv)
    files = []
    while args and not args[0].startswith("-"):
        files += ["--config", args.pop(0)]
    return files + args


def all_keys(method: str) -> list[str]:
    """Every key the config may hold (for suggestions)."""
    keys = ["seed", *CLASS_SECTIONS, "loggers", "trainer.method", "trainer.optimizer_kwargs"]
    keys += [f"{section}.{part}" for section in CLASS_SECTIONS for part in ("class_path", "init_args")]
    keys += [f"dictionary.{each.name}" for each in fields(DictionaryRule)]
    keys += ["engine", *(f"ray.{each.name}" for each in fields(RayOptions))]
    return keys + [f"trainer.{key.name}" for key in trainer_keys(method)]
