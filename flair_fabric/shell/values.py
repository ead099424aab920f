"""How the config's values are read: YAML, as jsonargparse reads it, except that a string is never taken for a null.

jsonargparse reads every string value once more as YAML before it checks the value's type (so that ``--trainer.devices
2`` is a number and ``--x null`` a ``None``). A string that YAML reads as nothing, such as ``"# "`` (a comment) or
``""``, then becomes ``None`` wherever the type allows one: flair's default ``comment_symbol="# "`` came out as
``comment_symbol: null`` in ``--print_config`` and ``config.yaml``, and a config that spelled it out trained with
``None``. Here such a string stays itself; only YAML's own spellings of null (``null``, ``~``) mean ``None``.
"""

from __future__ import annotations

from typing import Any

import yaml
from jsonargparse import get_loader, set_dumper, set_loader

MODE = "flair_fabric_yaml"
"""The parser mode of the train command's parsers (``ArgumentParser(parser_mode=MODE)``)."""

YAML_NULLS = frozenset({"null", "Null", "NULL", "~"})


def load(text: str) -> Any:
    """``text`` as YAML; a one-line text that YAML reads as nothing but does not spell null is the string itself."""
    value = get_loader("yaml")(text)
    is_one_value = "\n" not in text.strip()
    if value is None and is_one_value and text.strip() not in YAML_NULLS:
        return text
    return value


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string that :func:`load` would not read back as that string (PyYAML
    writes ``1e-5`` bare, since for PyYAML a float needs a dot, but jsonargparse's YAML reads it as a float)."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    try:
        reads_back = load(text) == text
    except yaml.YAMLError:
        reads_back = False
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=None if reads_back else "'")


_Dumper.add_representer(str, _represent_text)


def dump(data: Any) -> str:
    """YAML as jsonargparse writes it (block style, keys in order), each string written so that it reads back as
    itself."""
    return yaml.dump(data, Dumper=_Dumper, default_flow_style=False, sort_keys=False, allow_unicode=True)


set_loader(MODE, load, exceptions=(yaml.YAMLError,))
set_dumper(MODE, dump)
