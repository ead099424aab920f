"""A config's mistakes as the user can fix them: the key, the file and line that gave it (or the command line), and
for an unknown key the closest one."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from flair_fabric.storage import StorageError, check_reachable, is_url, read_text


class ConfigError(ValueError):
    """A config that cannot train; the message names the key, and where it was given."""


def config_files(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files of a command line, in order: local paths or URLs (``s3://bucket/run.yaml``)."""
    return [argv[i + 1] for i, each in enumerate(argv[:-1]) if each == "--config"]


def config_text(file: str | Path) -> str:
    """A config file's text, from a local path or through :mod:`flair_fabric.storage` for a URL."""
    return read_text(file) if is_url(file) else Path(file).read_text(encoding="utf-8")


def inlined(argv: Sequence[str]) -> list[str]:
    """``argv`` with each URL config file replaced by its text (jsonargparse reads a ``--config`` value that is no
    local file as YAML): the parser never opens a URL itself, and the messages still name the URL."""
    return [
        config_text(each) if index > 0 and argv[index - 1] == "--config" and is_url(each) else each
        for index, each in enumerate(argv)
    ]


def check_yaml(files: Sequence[str | Path]) -> None:
    """Each config file exists (a URL: can be read) and is YAML; else the file and the line of the mistake."""
    for file in files:
        if is_url(file):
            try:
                check_reachable(str(file), argument="config file")
            except StorageError as error:
                raise ConfigError(str(error)) from None
        elif not Path(file).is_file():
            raise ConfigError(f"{file}: no such config file.")
        try:
            yaml.safe_load(config_text(file))
        except yaml.YAMLError as error:
            problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
            context, opened = getattr(error, "context", None), getattr(error, "context_mark", None)
            first = opened or mark
            line = first.line + 1 if first is not None else None
            text = f"{context} (line {opened.line + 1}): " if context and opened is not None else ""
            text += f"{problem} (line {mark.line + 1})" if problem and mark is not None else str(problem or error)
            raise ConfigError(f"{file}{f':{line}' if line else ''}: YAML syntax error: {text}.") from None


def _line(file: str, path: Sequence[str]) -> tuple[int, int] | None:
    """(depth found, line) of the deepest node along ``path`` in one file; ``None`` where its first key is absent."""
    node = yaml.compose(config_text(file))
    found = None
    for depth, key in enumerate(path):
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
        if match is None:
            break
        found = (depth + 1, match[0].start_mark.line + 1)
        node = match[1]
    return found


def where(key: str, argv: Sequence[str]) -> str:
    """Where ``key`` was given: ``command line``, or ``FILE:LINE`` of the last file that holds it (deepest match)."""
    spellings = {key, key.replace(".init_args.", ".")}  # jsonargparse takes --model.x for --model.init_args.x
    if any(each.split("=", 1)[0].startswith(f"--{spelling}") for each in argv for spelling in spellings):
        return "command line"
    path = key.split(".")
    best: tuple[int, str] | None = None
    for file in reversed(config_files(argv)):
        found = _line(file, path)
        if found is not None and (best is None or found[0] > best[0]):
            best = (found[0], f"{file}:{found[1]}")
    return best[1] if best is not None else "config"


def unknown_part(key: str, known: Sequence[str]) -> str:
    """The shortest leading part of ``key`` that no known key starts with (``modle`` of ``modle.init_args.x``)."""
    parts = key.split(".")
    for end in range(1, len(parts) + 1):
        candidate = ".".join(parts[:end])
        if not any(each == candidate or each.startswith(candidate + ".") for each in known):
            return candidate
    return key


def closest_key(key: str, known: Sequence[str]) -> str | None:
    """The known key closest to an unknown one."""
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return match[0] if match else None


def key_of(message: str) -> str | None:
    """The config key a jsonargparse message is about (its ``init_args`` spelled out)."""
    unknown = re.search(r"Option '([^']+)' is not accepted", message)
    keys = re.findall(r'Parser key "([^"]+)"', message)
    unrecognized = re.search(r"unrecognized arguments: --(\S+)", message)
    if unrecognized:
        return unrecognized.group(1).split("=", 1)[0]
    if not keys:
        return unknown.group(1) if unknown else None
    path = [keys[0], *(f"init_args.{k}" for k in keys[1:])]
    if unknown and "class_path" in message:
        path.append(f"init_args.{unknown.group(1)}")
    elif unknown:
        return unknown.group(1)
    elif (
        len(keys) == 1
        and "Problem with given class_path" in message
        and "Parser key" not in message.split("Problem with given class_path", 1)[1]
    ):
        path.append("class_path")
    return ".".join(path)


_NESTED_ARG = re.compile(r"NestedArg\(key='([^']*)', val=(.*?)\)")
"""How jsonargparse shows a command line override (``--model.init_args.x 1``) in its messages."""

_NOISE = (
    "Subtypes:",
    "Given value type:",
    "Does not validate against",
    "Errors:",
    "Parser key",
    "- Expected a <class 'NoneType'>",
)


def _useful(lines: list[str]) -> list[str]:
    """The lines of a jsonargparse message that say what is wrong (not which union members were tried; only the
    innermost given value)."""
    useful = [
        text.removeprefix("- ").rstrip(":") for text in map(str.strip, lines) if text and not text.startswith(_NOISE)
    ]
    values = [i for i, text in enumerate(useful) if text.startswith("Given value:")]
    return [text for i, text in enumerate(useful) if i not in values[1:]]


def _unknown_argument(key: str, message: str, argv: Sequence[str]) -> ConfigError:
    """An argument a config's class does not take, with the class's closest one."""
    from flair_fabric.shell.signatures import argument_names

    class_path = re.search(r"Problem with given class_path '([^']+)'", message)
    name = key.rsplit(".", 1)[-1]
    taken = argument_names(class_path.group(1)) if class_path else []
    suggestion = closest_key(name, taken)
    of_class = f" of {class_path.group(1)}" if class_path else ""
    hint = f"; did you mean '{suggestion}'?" if suggestion else f"; it takes: {', '.join(taken)}." if taken else "."
    return ConfigError(f"{where(key, argv)}: {key}: unknown argument{of_class}{hint}")


def explain(message: str, argv: Sequence[str], known: Sequence[str]) -> ConfigError:
    """A jsonargparse error as a :class:`ConfigError`: where, which key, what is wrong, and a suggestion."""
    message = _NESTED_ARG.sub(lambda match: f"{match.group(1)}={match.group(2)}", message)
    key = key_of(message)
    if key is None:
        return ConfigError(message)
    if "is not accepted" in message and "class_path" in message:
        return _unknown_argument(key, message, argv)
    is_unknown = ("is not accepted" in message and "class_path" not in message) or "unrecognized" in message
    if is_unknown:
        key = unknown_part(key, known)
        suggestion = closest_key(key, known)
        hint = f"; did you mean '{suggestion}'?" if suggestion else "; see python -m flair_fabric train --help."
        return ConfigError(f"{where(key, argv)}: {key}: unknown key{hint}")
    detail = "; ".join(_useful(message.splitlines()))
    return ConfigError(f"{where(key, argv)}: {key}: {detail}")
