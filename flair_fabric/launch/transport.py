"""Send flair objects to spawned processes, where plain pickling fails.

Three things in flair defeat plain pickling: models holding ``TransformerEmbeddings`` (its ``__setstate__`` passes
``instance_parameters`` to the transformer's constructor), sentences with span or relation labels (``Span`` and
``Relation`` need arguments in ``__new__``), and the links between neighbouring sentences of a corpus
(``_previous_sentence``/``_next_sentence``, which flair sets for ``use_context``): pickle follows them sentence by
sentence, one level of recursion each, and a ``ColumnCorpus`` of a few hundred sentences exceeds Python's recursion
limit. This pickler, used only for what ``ddp_spawn`` sends to its workers, moves a model by its flair state (the
dictionary ``model.save`` writes, rebuilt with the class's ``load``), rebuilds spans and relations from their
attributes, and sends the sentence links after the object, in flat batches, so their depth never grows. flair's
classes are left as they are.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO, Any

import flair
from flair.data import Relation, Sentence, Span

from flair_fabric.state.model_state import model_from_bytes, model_to_bytes
from flair_fabric.state.safe_loading import open_private

_LINKS = ("_previous_sentence", "_next_sentence")
Links = list[tuple[Sentence, Sentence | None, Sentence | None]]


class _FlairPickler(pickle.Pickler):
    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.links: Links = []  # the links of the sentences pickled so far, not yet sent

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, flair.nn.Model):
            return model_from_bytes, (type(obj), model_to_bytes(obj))
        if type(obj) in (Span, Relation):
            # skip the constructor (it registers the object with its sentence, which the state already holds)
            return object.__new__, (type(obj),), obj.__dict__
        if isinstance(obj, Sentence) and any(getattr(obj, name, None) is not None for name in _LINKS):
            state = {key: value for key, value in obj.__dict__.items() if key not in _LINKS}
            self.links.append((obj, obj._previous_sentence, obj._next_sentence))
            return object.__new__, (type(obj),), state
        return NotImplemented


def dump(obj: Any, file: IO[bytes]) -> None:
    """Pickle ``obj`` into ``file``, moving flair models by their flair state, rebuilding spans without their
    constructor and sending sentence links afterwards (a neighbour outside ``obj`` is sent too, as plain pickling
    would)."""
    pickler = _FlairPickler(file)
    pickler.dump(obj)
    while pickler.links:  # one pickler: the sentences already sent are references (its memo holds them)
        batch, pickler.links = pickler.links, []
        pickler.dump(batch)
    pickler.dump(None)


def dumps(obj: Any) -> bytes:
    """:func:`dump` into bytes."""
    buffer = io.BytesIO()
    dump(obj, buffer)
    return buffer.getvalue()


def dump_private(obj: Any, path: Path) -> None:
    """:func:`dump` into a new file only its owner can read (0o600), as spawned workers receive their job."""
    with open_private(path) as stream:
        dump(obj, stream)


def load(file: IO[bytes]) -> Any:
    """Unpickle what :func:`dump` wrote; flair models are rebuilt on the current ``flair.device``."""
    unpickler = pickle.Unpickler(file)  # one unpickler: the link batches refer to the object's sentences
    obj = unpickler.load()
    while (batch := unpickler.load()) is not None:
        for sentence, previous, following in batch:
            sentence._previous_sentence, sentence._next_sentence = previous, following
    return obj


def loads(data: bytes) -> Any:
    """:func:`load` from bytes."""
    return load(io.BytesIO(data))


def load_file(path: Path) -> Any:
    """:func:`load` from the file at ``path``."""
    with path.open("rb") as stream:
        return load(stream)
