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
from typing import Any, TypeVar, cast

import flair
import torch
from flair.data import Relation, Span


def _model_state(model: flair.nn.Model) -> bytes:
    state = model._get_state_dict()
    if model.model_card is not None:
        state["model_card"] = model.model_card
    buffer = io.BytesIO()
    torch.save(state, buffer, pickle_protocol=4)
    return buffer.getvalue()


def _model_from_state(model_class: type[flair.nn.Model], state: bytes) -> flair.nn.Model:
    """Rebuild a flair model on ``flair.device`` from the bytes of its flair state."""
    loaded = torch.load(io.BytesIO(state), map_location="cpu", weights_only=False)
    model = model_class.load(loaded)
    if "model_card" in loaded:
        model.model_card = loaded["model_card"]
    return model


class _FlairPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, flair.nn.Model):
            return _model_from_state, (type(obj), _model_state(obj))
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


ModelT = TypeVar("ModelT", bound=flair.nn.Model)


def copy_model(model: ModelT) -> ModelT:
    """An independent copy of a flair model with the same weights, rebuilt from its flair state in memory
    (``copy.deepcopy`` fails on transformer embeddings). Usually needs one extra model's memory, no serialised bytes.
    Rebuilding draws random initial weights; the random number generators are left as they were."""
    state = model._get_state_dict()  # holds the model's own tensors: nothing is copied yet
    devices = [torch.cuda.current_device()] if flair.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        copy = type(model).load(state)
        originals = {id(parameter) for parameter in model.parameters()}
        if any(id(parameter) in originals for parameter in copy.parameters()):
            # the state held a module itself (a custom decoder): go through bytes for an independent copy
            copy = _model_from_state(type(model), _model_state(model))
    copy.model_card = model.model_card
    return cast(ModelT, copy)
