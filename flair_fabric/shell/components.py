"""The config's second pass: the classes it names, imported and checked with jsonargparse, then made.

The corpus, the embeddings, the loggers and the trainer's class-typed keys (``optimizer``, ``plugins``, ``sampler``)
are jsonargparse subclass specs (``class_path``/``init_args``), checked against each class's signature before any of
them is made. The model is checked the same way but made here, with the embeddings and the label dictionary that
comes from the corpus (:func:`label_dictionary`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flair
from flair.data import Corpus, Dictionary
from flair.embeddings import Embeddings
from flair.trainers import ModelTrainer
from jsonargparse import ArgumentParser, Namespace
from jsonargparse.typing import import_object
from lightning.fabric.loggers import Logger

from flair_fabric.plugins.trackers import Tracker
from flair_fabric.shell.errors import ConfigError
from flair_fabric.shell.options import make_parser, trainer_keys
from flair_fabric.shell.signatures import init_parameters

CORPUS = "corpus"
"""The argument a class (or a classmethod that makes one, ``OneHotEmbeddings.from_corpus``) gets the made corpus by."""

MADE_HERE = ("embeddings", "tag_dictionary", "label_dictionary", CORPUS)
"""The model's arguments that the config does not give: the made embeddings, the corpus's label dictionary, and the
corpus itself where the model asks for one."""

LABEL_TYPE_NAMES = ("tag_type", "label_type")


def _imported_callable(class_path: Any) -> Any:
    try:
        return import_object(class_path) if isinstance(class_path, str) else None
    except (ImportError, AttributeError, ValueError):
        return None


def _imported(class_path: Any) -> type | None:
    found = _imported_callable(class_path)
    return found if inspect.isclass(found) else None


def assumed_parameters(cls: type | None) -> set[str]:
    """The parameters that only an ancestor of a class requires, reached by the class's ``**kwargs``.

    jsonargparse follows ``**kwargs`` up the class hierarchy and asks for them; flair's transformer embeddings pass
    theirs to ``transformers`` and give their parent's required ``tokenizer``, ``embedding_length``, ... themselves.
    They are left out of the check (the class itself refuses what it does not take)."""
    if cls is None:
        return set()
    own = inspect.signature(cls).parameters
    return {
        name for name, p in init_parameters(cls).items() if name not in own and p.default is inspect.Parameter.empty
    }


def _takes_corpus(target: Any) -> bool:
    return callable(target) and CORPUS in init_parameters(target)


def _classmethod_arguments(target: Any, base: type) -> Callable[..., None]:
    """A section made by a classmethod of a ``base`` subclass (``OneHotEmbeddings.from_corpus``): ``class_path`` and
    ``init_args`` checked against the method's signature (what its ``**kwargs`` reach included), the corpus left out:
    the command hands it in."""
    owner = getattr(target, "__self__", None)
    if not (inspect.isclass(owner) and issubclass(owner, base)):
        return _subclass(base, required=False, skip={CORPUS}, instantiate=False)  # jsonargparse says what is wrong

    def add(parser: ArgumentParser, key: str) -> None:
        parser.add_argument(f"--{key}.class_path", type=str, help="a classmethod that makes the class from the corpus")
        parser.add_method_arguments(owner, target.__name__, f"{key}.init_args", skip={CORPUS}, fail_untyped=False)

    return add


def _embeddings_type(class_path: Any) -> Callable[..., None]:
    """The embeddings section: a subclass spec; one that asks for the corpus is made by the command with it."""
    target = _imported_callable(class_path)
    if not _takes_corpus(target):
        return _subclass(Embeddings, required=False, skip=assumed_parameters(_imported(class_path)))
    if inspect.isclass(target):
        skip = assumed_parameters(target) | {CORPUS}
        return _subclass(Embeddings, required=False, skip=skip, instantiate=False)
    return _classmethod_arguments(target, Embeddings)


def _subclass(base: type, *, required: bool, skip: set[str], instantiate: bool = True) -> Callable[..., None]:
    def add(parser: ArgumentParser, key: str) -> None:
        parser.add_subclass_arguments(base, key, required=required, skip=skip, instantiate=instantiate)

    return add


def class_types(method: str, first_pass: Namespace) -> dict[str, Any]:
    """The types of the class sections and of the trainer's class-typed keys (flair's own annotations)."""
    embeddings = first_pass.get("embeddings") or {}
    method_signature = inspect.signature(getattr(ModelTrainer, method)).parameters
    custom_signature = inspect.signature(ModelTrainer.train_custom).parameters
    trainer = {}
    for key in trainer_keys(method):
        if key.needs_import:
            parameter = method_signature.get(key.name) or custom_signature[key.name]
            trainer[key.name] = (parameter.annotation, parameter.default)
    return {
        "corpus": _subclass(Corpus, required=True, skip=set()),
        "embeddings": _embeddings_type(embeddings.get("class_path")),
        "model": _subclass(flair.nn.Model, required=True, skip=set(MADE_HERE), instantiate=False),
        "loggers": list[Logger | Tracker],
        "trainer": trainer,
    }


def second_pass_parser(method: str, first_pass: Namespace) -> ArgumentParser:
    """The parser that checks the classes too (it imports them)."""
    return make_parser(method, class_types=class_types(method, first_pass))


def label_dictionary(corpus: Corpus, rule: Namespace, model_class: type, model_args: dict[str, Any]) -> Dictionary:
    """The documented rule: ``corpus.make_label_dictionary`` for ``dictionary.label_type`` (default: the model's
    ``tag_type`` or ``label_type``), with ``dictionary.min_count``, ``add_unk`` and ``add_dev_test``."""
    label_type = rule.label_type or next((model_args[n] for n in LABEL_TYPE_NAMES if model_args.get(n)), None)
    if label_type is None:
        raise ConfigError(
            f"dictionary.label_type: {model_class.__name__} takes a label dictionary, but neither dictionary.label_type"
            " nor the model's tag_type/label_type says which labels to collect; set one of them."
        )
    return corpus.make_label_dictionary(
        label_type, min_count=rule.min_count, add_unk=rule.add_unk, add_dev_test=rule.add_dev_test
    )


def _takes(model_class: type, name: str) -> bool:
    return name in init_parameters(model_class)


def _made_with_corpus(section: Any, corpus: Corpus) -> Any:
    """A section jsonargparse left unmade because it asks for the corpus, made with it; anything else as it is."""
    if not isinstance(section, Namespace):
        return section
    init_args = section.init_args.as_dict() if section.get("init_args") else {}
    return import_object(section.class_path)(**init_args, corpus=corpus)


@dataclass
class Components:
    """What the config makes: the corpus, the model, and the trainer's keyword arguments (the loggers among the
    plugins)."""

    corpus: Corpus
    model: flair.nn.Model
    method: str
    trainer_arguments: dict[str, Any]
    loggers: list[Logger | Tracker]


def make_components(parser: ArgumentParser, config: Namespace, given: Namespace) -> Components:
    """Seed, then make the corpus, the embeddings, the loggers and the plugins, then the model (this reads the data).

    ``config`` is the whole parsed config; ``given`` holds only what the config gives (``defaults=False``): the
    classes and the trainer get exactly those arguments, as in a script, so flair's own defaults apply."""
    if config.seed is not None:
        flair.set_seed(config.seed)
    made = parser.instantiate_classes(given)
    model_class = import_object(config.model.class_path)
    model_args = made.model.init_args.as_dict() if made.model.get("init_args") else {}  # nested classes made
    embeddings = _made_with_corpus(made.get("embeddings"), made.corpus)
    if embeddings is not None and _takes(model_class, "embeddings"):
        model_args["embeddings"] = embeddings
    if _takes(model_class, CORPUS):
        model_args[CORPUS] = made.corpus
    for name in ("tag_dictionary", "label_dictionary"):
        if _takes(model_class, name):
            model_args[name] = label_dictionary(made.corpus, config.dictionary, model_class, model_args)
    model = model_class(**model_args)
    trainer = made.trainer.as_dict() if made.get("trainer") else {}
    trainer.pop("method", None)
    trainer.update(trainer.pop("optimizer_kwargs", None) or {})
    return Components(made.corpus, model, config.trainer.method, trainer, list(made.get("loggers") or []))
