"""Send flair objects to spawned processes, where plain pickling fails.

Two things in flair cannot be pickled: models holding ``TransformerEmbeddings`` (its ``__setstate__`` passes
``instance_parameters`` to the transformer's constructor) and sentences with span or relation labels (``Span`` and
``Relation`` need arguments in ``__new__``). This pickler, used only for what ``ddp_spawn`` sends to its workers,
moves a model by its flair state (the dictionary ``model.save`` writes, rebuilt with the class's ``load``) and
rebuilds spans and relations from their attributes. flair's classes are left as they are.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import flair
from flair.data import Relation, Span

from flair_fabric.state.model_state import model_from_bytes, model_to_bytes


class _FlairPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, flair.nn.Model):
            return model_from_bytes, (type(obj), model_to_bytes(obj))
        if type(obj) in (Span, Relation):
            # skip the constructor (it registers the object with its sentence, which the state already holds)
            return object.__new__, (type(obj),), obj.__dict__
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``, moving flair models by their flair state and rebuilding spans without their constructor."""
    buffer = io.BytesIO()
    _FlairPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` wrote; flair models are rebuilt on the current ``flair.device``."""
    return pickle.loads(data)
