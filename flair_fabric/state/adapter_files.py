"""The unmerged adapters beside a model file (``save_adapters=True``), for people who ship adapters on their own.

A model file (``best-model.pt``) holds the adapters merged into the transformer (:mod:`flair_fabric.state.adapters`);
with ``save_adapters`` global rank 0 also writes ``best-model.adapter/``: peft's own ``PeftModel.save_pretrained``
folder of the adapted transformer (``adapter_config.json``, ``adapter_model.safetensors``), which
``PeftModel.from_pretrained(<the pretrained transformer>, folder)`` loads. A model with several adapted transformer
embeddings (a ``StackedEmbeddings``) gets one such folder per embeddings inside it, named by the embeddings' attribute
path in the model (``embeddings.list_embedding_0``). flair's own layers (the decoder) are in the model file only.

The folder is written whole into a temporary folder beside it, then renamed into place (the previous one renamed aside
first): a reader never sees a half-written folder, and a failed write leaves the previous one. Once the model holds a
model file's merged weights (:data:`~flair_fabric.state.adapters.MERGED_BASE`) no folder is written.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from flair_fabric.state.adapters import MERGED_BASE, adapted_embeddings, has_adapters

log = logging.getLogger("flair")

SUFFIX = ".adapter"
"""``best-model.pt``'s adapters are in ``best-model.adapter/``."""


def adapter_folder(model_file: str | Path) -> Path:
    """The adapters' folder beside ``model_file``."""
    return Path(model_file).with_suffix(SUFFIX)


def check_save_adapters(model: torch.nn.Module, save_adapters: bool) -> None:
    """Before anything starts: ``save_adapters=True`` needs a model with adapters."""
    if save_adapters and not has_adapters(model):
        raise ValueError(
            f"save_adapters=True: the {type(model).__name__} has no transformer embeddings with peft adapters, so"
            " there are no adapters to write: give its TransformerEmbeddings a peft_config (a peft.LoraConfig), or"
            " leave save_adapters out."
        )


def write_adapter_folders(
    model: torch.nn.Module, model_file: str | Path, weights: dict[str, torch.Tensor] | None = None
) -> Path | None:
    """Write the unmerged adapters of ``model`` beside ``model_file`` (global rank 0 only); ``weights``: the whole
    weights of a sharded model, else ``model.state_dict()``. Returns the folder, ``None`` when nothing was written:
    after a model file's merged weights were loaded into the model, its adapters alone no longer give the model, so
    no folder is written and one left from an earlier model file of that name is removed (a warning says so)."""
    adapted = list(adapted_embeddings(model))
    if not adapted:
        return None
    folder = adapter_folder(model_file)
    if any(getattr(embeddings, MERGED_BASE, False) for _, embeddings in adapted):
        log.warning(
            f"save_adapters: {folder.name} is not written (and an earlier one is removed): the model's transformer"
            " holds the merged weights of a model file loaded into it (the final test loads best-model.pt; a"
            " restart from the best model or a plugin's load_model may too), so its adapters alone no longer give"
            f" the model; {Path(model_file).name} holds it."
        )
        _replace_folder(None, folder)
        return None
    state = weights if weights is not None else model.state_dict()

    def write(temporary: Path) -> None:
        for name, embeddings in adapted:
            inner = f"{name}.model." if name else "model."
            lora = {
                key.removeprefix(inner): tensor.detach().cpu()
                for key, tensor in state.items()
                if key.startswith(inner) and ".lora_" in key
            }
            target = temporary if len(adapted) == 1 else temporary / name
            embeddings.model.save_pretrained(str(target), state_dict=lora, save_embedding_layers=False)

    write_folder_atomically(folder, write)
    return folder


def write_folder_atomically(folder: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` into a new temporary folder beside ``folder``, then renamed to ``folder`` (a previous one
    is moved aside first and removed after)."""
    temporary = folder.parent / f".{folder.name}.{uuid.uuid4().hex}.tmp"
    temporary.mkdir()  # the usual permissions (the umask's)
    try:
        write(temporary)
        _replace_folder(temporary, folder)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _replace_folder(new: Path | None, folder: Path) -> None:
    """``new`` (``None``: nothing) in place of ``folder``; the old one is moved aside by a rename, then removed."""
    old = folder.parent / f".{folder.name}.{uuid.uuid4().hex}.old"
    if folder.exists():
        folder.rename(old)
    if new is not None:
        new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def delete_previous_best_models(base_path: Path, delete_files: Callable[[Path], None]) -> None:
    """At a fresh run's start (global rank 0): an earlier run's ``best-model*.adapter`` folders, then flair's own
    removal of its ``best-model*`` files (``delete_files``: flair's ``check_for_and_delete_previous_best_models``,
    which removes files only and fails on a folder)."""
    for folder in sorted(base_path.glob(f"best-model*{SUFFIX}")):
        if folder.is_dir():
            _replace_folder(None, folder)
    delete_files(base_path)
