"""The arguments a config's class takes: its own named parameters and, where it takes ``**kwargs``, those of its
ancestors' ``__init__`` (what jsonargparse lets the ``**kwargs`` reach). Imports nothing heavy."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jsonargparse.typing import import_object


def own_parameters(target: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named parameters of ``target``'s own signature (not its ``*args`` or ``**kwargs``)."""
    own = inspect.signature(target).parameters
    return {name: p for name, p in own.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def init_parameters(target: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named parameters of ``target`` (a class or a function that makes one) and, for a class that takes
    ``**kwargs``, of the ``__init__`` of its ancestors, the class's own first."""
    own = inspect.signature(target).parameters
    parameters = own_parameters(target)
    if inspect.isclass(target) and any(p.kind == p.VAR_KEYWORD for p in own.values()):
        for ancestor in target.__mro__[1:]:
            if "__init__" in vars(ancestor) and ancestor is not object:
                for name, p in inspect.signature(vars(ancestor)["__init__"]).parameters.items():
                    if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                        parameters.setdefault(name, p)
    return parameters


def argument_names(class_path: str) -> list[str]:
    """The arguments the class (or function) at ``class_path`` takes; none where it does not import."""
    try:
        return list(init_parameters(import_object(class_path)))
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
