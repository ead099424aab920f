"""A flair model's own state: what ``Model.save`` writes, as a dictionary, as bytes, and back as a model.

flair saves a model as the dictionary ``model._get_state_dict()`` (constructor arguments, weights, dictionaries)
plus its model card, pickled by ``torch.save``; ``type(model).load`` rebuilds it from that dictionary. This module is
the one place flair-fabric builds that dictionary: for model files written with the consolidated weights of a
sharded model, for moving a model to spawned processes, and for copying a model without ``copy.deepcopy`` (which
fails on flair's transformer embeddings).
"""

from __future__ import annotations

import io
from typing import Any, TypeVar, cast

import flair
import torch

from flair_fabric.state.adapters import has_adapters, merged_weights, with_adapter_configs

ModelT = TypeVar("ModelT", bound=flair.nn.Model)


def flair_state(model: flair.nn.Model, weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The dictionary flair's ``Model.save`` writes for ``model``; ``weights`` in place of ``model.state_dict()``
    if given (the consolidated weights of a sharded model)."""
    state = with_adapter_configs(model, model._get_state_dict())  # flair 0.15.1 leaves peft_config out
    if weights is not None:
        state["state_dict"] = weights
    if model.model_card is not None:
        state["model_card"] = model.model_card
    return state


def model_file_state(model: flair.nn.Model, weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """What a flair model file of ``model`` holds: :func:`flair_state`, except that a model with peft adapters is
    written as the plain model with the adapters merged into its transformer, which stock flair loads (docs/peft.md)."""
    if not has_adapters(model):
        return flair_state(model, weights)
    state = model._get_state_dict()
    state["state_dict"] = merged_weights(model, weights)
    if model.model_card is not None:
        state["model_card"] = model.model_card
    return state


def save_flair_state(state: dict[str, Any], target: Any) -> None:
    """Write a flair state the way ``Model.save`` writes it (to a path or a binary stream)."""
    torch.save(state, target, pickle_protocol=4)


def model_to_bytes(model: flair.nn.Model) -> bytes:
    """The bytes a flair model file of ``model`` holds."""
    buffer = io.BytesIO()
    save_flair_state(flair_state(model), buffer)
    return buffer.getvalue()


def model_from_bytes(model_class: type[ModelT], data: bytes) -> ModelT:
    """Rebuild a flair model on ``flair.device`` from the bytes of its flair state (flair's own ``load``: a pickle,
    only for bytes this process or its caller produced)."""
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    model = model_class.load(loaded)
    if "model_card" in loaded:
        model.model_card = loaded["model_card"]
    return cast(ModelT, model)


def copy_model(model: ModelT) -> ModelT:
    """An independent copy of a flair model with the same weights, rebuilt from its flair state in memory
    (``copy.deepcopy`` fails on transformer embeddings). Usually needs one extra model's memory, no serialised bytes.
    Rebuilding draws random initial weights; the random number generators are left as they were."""
    state = with_adapter_configs(model, model._get_state_dict())  # holds the model's own tensors: nothing copied yet
    devices = [torch.cuda.current_device()] if flair.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        copy = type(model).load(state)
        originals = {id(parameter) for parameter in model.parameters()}
        if any(id(parameter) in originals for parameter in copy.parameters()):
            # the state held a module itself (a custom decoder): go through bytes for an independent copy
            copy = model_from_bytes(type(model), model_to_bytes(model))
    copy.model_card = model.model_card
    return cast(ModelT, copy)
