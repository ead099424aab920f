"""Files flair-fabric reads back hold data, never code: checked before anything in them is used.

A pickle can run any code while it is read. Everything flair-fabric writes and reads back is therefore loaded with
PyTorch's ``weights_only=True`` unpickler (tensors, numbers, strings, lists, tuples, dicts, plus the few types
named in an allow-list) or as JSON. One part of a sharded (``"fsdp"``) checkpoint is read by PyTorch's distributed
checkpoint code with a plain unpickler (its ``.metadata`` file and the non-tensor items of its ``.distcp`` files):
:func:`check_checkpoint_folder` reads those with an allow-list first, so a tampered checkpoint is refused, naming the
file, before any of it runs. flair's own model files (``best-model.pt``, ``final-model.pt``) are pickles by flair's
design: load them only from sources you trust (``docs/security.md``).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

try:  # numpy 2
    from numpy._core.multiarray import scalar as _numpy_scalar
except ImportError:  # numpy 1
    from numpy.core.multiarray import scalar as _numpy_scalar  # type: ignore[no-redef]

NUMPY_SCALARS: tuple[type | Any, ...] = (
    _numpy_scalar,
    np.dtype,
    *(type(np.dtype(name)) for name in ("float64", "float32", "int64", "int32", "bool")),
)
"""What a numpy number (as in metric results) needs to load with ``weights_only=True``."""


class UnsafeFile(ValueError):
    """A file that should hold plain data holds something else (code, or objects of unexpected classes)."""


def load_data(source: str | Path | io.BytesIO, allowed: Iterable[type] = ()) -> Any:
    """``torch.load`` of data only: tensors, plain Python values, and the classes in ``allowed``."""
    with torch.serialization.safe_globals([*allowed, *NUMPY_SCALARS]):
        return torch.load(source, map_location="cpu", weights_only=True)


def open_private(path: Path) -> IO[bytes]:
    """A new file at ``path`` only its owner can read (0o600, whatever the umask), open for writing bytes."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def save_private(data: Any, path: Path) -> None:
    """``torch.save(data, path)`` into a new file only its owner can read (0o600)."""
    with open_private(path) as stream:
        torch.save(data, stream)


def checked_load(path: Path, allowed: Iterable[type] = ()) -> Any:
    """:func:`load_data` of ``path``; anything but plain data raises :class:`UnsafeFile` naming the file."""
    try:
        return load_data(path, allowed)
    except Exception as error:
        raise UnsafeFile(f"{path} does not hold plain data ({type(error).__name__}: {str(error)[:200]})") from None


def _is_distributed_checkpoint_class(module: str, name: str) -> bool:
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        return True
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    """Reads the ``.metadata`` of a PyTorch distributed checkpoint, refusing every class outside its own types."""

    def find_class(self, module: str, name: str) -> Any:
        if not _is_distributed_checkpoint_class(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's metadata")
        return super().find_class(module, name)


def check_distributed_checkpoint(folder: Path) -> None:
    """Check a PyTorch distributed checkpoint folder (``fabric.save`` under ``"fsdp"``) without running any of it.

    Its ``.metadata`` is read with an allow-list; every item PyTorch would unpickle unrestricted (its non-tensor
    items) is read with ``weights_only=True`` from the byte range the metadata names; Lightning's ``meta.pt`` too.
    """
    metadata_file = folder / ".metadata"
    try:
        with metadata_file.open("rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        storage = metadata.storage_data
    except Exception as error:
        raise UnsafeFile(f"{metadata_file} does not hold plain data ({type(error).__name__}: {error})") from None
    byte_items = {
        name for name, entry in metadata.state_dict_metadata.items() if type(entry).__name__ == "BytesStorageMetadata"
    }
    first_of_file: dict[str, Any] = {}
    for info in storage.values():  # one item of every file: a file replaced whole is found before training starts
        if info.relative_path not in first_of_file or info.offset < first_of_file[info.relative_path].offset:
            first_of_file[info.relative_path] = info
    checked = [info for index, info in storage.items() if getattr(index, "fqn", None) in byte_items]
    for info in [*checked, *first_of_file.values()]:  # tensors elsewhere: PyTorch reads them with weights_only=True
        path = folder / str(info.relative_path)
        try:
            with path.open("rb") as stream:
                stream.seek(info.offset)
                load_data(io.BytesIO(stream.read(info.length)))
        except Exception as error:
            raise UnsafeFile(f"{path} does not hold plain data ({type(error).__name__}: {str(error)[:200]})") from None
    if (folder / "meta.pt").exists():
        checked_load(folder / "meta.pt")


def as_plain_data(value: Any) -> Any:
    """``value`` with every part that is not plain data (numbers, strings, tensors, lists, tuples, dicts) replaced
    by its text, e.g. a model card's training parameters for a file loaded with ``weights_only=True``."""
    if isinstance(value, dict):
        return {key if isinstance(key, str | int) else str(key): as_plain_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(as_plain_data(item) for item in value)
    if isinstance(value, str):
        return value.encode().decode()  # a plain str (torch.__version__ is a str subclass)
    if value is None or type(value) in (int, float, bool) or isinstance(value, torch.Tensor):
        return value
    return str(value)
