"""flair's training methods' parameters, read from flair's source without importing flair (seconds of imports).

The names, defaults, annotations (as written) and the docstring lines of ``ModelTrainer.train``, ``fine_tune`` and
``train_custom`` come from ``flair/trainers/trainer.py`` itself, so the command line follows the installed flair.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("train", "fine_tune", "train_custom")
"""The training methods a config may name (``trainer.method``)."""

NO_DEFAULT = object()
"""The default of a parameter that has none (``base_path``)."""


@dataclass(frozen=True)
class FlairParameter:
    """One parameter of a flair training method, as written in flair's source."""

    name: str
    default: Any
    """The default value, or :data:`NO_DEFAULT`; a default that is no literal (``torch.optim.SGD``) as its text."""
    annotation: str
    doc: str


def _trainer_source() -> Path:
    spec = importlib.util.find_spec("flair")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flair is not installed: pip install flair-fabric installs it.")
    return Path(next(iter(spec.submodule_search_locations))) / "trainers" / "trainer.py"


def _docs(docstring: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section (continuation lines joined)."""
    docs: dict[str, str] = {}
    name = None
    for line in docstring.split("Args:", 1)[-1].splitlines():
        stripped = line.strip()
        head, _, text = stripped.partition(":")
        if text and head.split(" ")[0].isidentifier() and line.startswith(" " * 4) and not line.startswith(" " * 5):
            name = head.split(" ")[0]
            docs[name] = text.strip()
        elif stripped.startswith("*"):
            name = None  # **kwargs: not a key
        elif name and stripped and not stripped.endswith(":"):
            docs[name] += " " + stripped
        elif not stripped:
            name = None
    return docs


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


@functools.cache
def flair_parameters() -> dict[str, dict[str, FlairParameter]]:
    """Per training method, its named parameters in order (``self`` and ``**kwargs`` left out)."""
    tree = ast.parse(_trainer_source().read_text(encoding="utf-8"))
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelTrainer")
    methods: dict[str, dict[str, FlairParameter]] = {}
    for node in trainer.body:
        if isinstance(node, ast.FunctionDef) and node.name in METHODS:
            args = node.args.args[1:]
            defaults = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
            docs = _docs(ast.get_docstring(node) or "")
            methods[node.name] = {
                arg.arg: FlairParameter(
                    arg.arg,
                    _default(default),
                    ast.unparse(arg.annotation) if arg.annotation else "Any",
                    docs.get(arg.arg, ""),
                )
                for arg, default in zip(args, defaults, strict=True)
            }
    return methods


def method_parameters(method: str) -> dict[str, FlairParameter]:
    """The parameters ``method`` takes, with its defaults: its own, then those it passes on to ``train_custom``
    (documented there)."""
    every = flair_parameters()
    custom = every["train_custom"]
    own = {
        name: FlairParameter(name, p.default, p.annotation, p.doc or (custom[name].doc if name in custom else ""))
        for name, p in every[method].items()
    }
    return {**own, **{name: p for name, p in custom.items() if name not in own}}
