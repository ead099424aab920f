"""Paths and URLs as one kind of thing: the one place that turns a path or URL (``s3://``, ``gs://``, any fsspec URL)
into an fsspec filesystem, checks that it can be reached, reads it and writes it whole.

Credentials and endpoints come the provider's standard way (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... in the
environment, or its config files); ``storage_options`` passes them explicitly. No message names a credential.
A local path keeps its own code: nothing here imports torch or Lightning unless a URL is given.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""The flair-fabric extra that installs a scheme's filesystem."""

SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")


class StorageError(ValueError):
    """A path or URL that cannot be used: the message names the argument, the path and the fix."""


def is_url(path: object) -> bool:
    """``True`` for ``scheme://...`` (a string), ``False`` for a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def _scheme(url: str) -> str:
    match = _URL.match(url)
    assert match is not None, url
    return match.group(1).lower()


def _check_installed(url: str, argument: str) -> None:
    """The URL's scheme is one fsspec knows and its package is installed; else which extra or package to install."""
    from fsspec.registry import known_implementations, registry

    scheme = _scheme(url)
    if scheme in registry:
        return
    known = known_implementations.get(scheme)
    if known is None:
        schemes = ", ".join(sorted(known_implementations))
        raise StorageError(f"{argument}={url!r}: unknown URL scheme {scheme}://; fsspec knows: {schemes}.")
    package = known["class"].split(".", 1)[0]
    if importlib.util.find_spec(package) is None:
        extra = EXTRAS.get(scheme)
        fix = f"pip install flair-fabric[{extra}]" if extra else f"pip install {package}"
        raise StorageError(f"{argument}={url!r}: {scheme}:// needs {package}, which is not installed: {fix}.")


def filesystem(path: str | Path, storage_options: Mapping[str, Any] | None = None, *, argument: str = "path") -> Any:
    """The fsspec filesystem of ``path`` (Lightning's ``get_filesystem``); a local path gets the local one."""
    if is_url(path):
        _check_installed(str(path), argument)
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return get_filesystem(path, **dict(storage_options or {}))


def _secrets(storage_options: Mapping[str, Any] | None) -> list[str]:
    values = [os.environ.get(name, "") for name in SECRET_VARIABLES]
    values += [str(value) for value in (storage_options or {}).values() if isinstance(value, str)]
    return [value for value in values if len(value) >= 4]


def _unreachable(url: str, argument: str, error: BaseException, storage_options: Mapping[str, Any] | None) -> str:
    """One line: the path, what went wrong and the fix; any credential in the cause is blanked out."""
    name = type(error).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        fix = "no credentials found: set the provider's variables (AWS_ACCESS_KEY_ID, ...) or pass storage_options"
    elif isinstance(error, PermissionError):
        fix = f"access denied ({error}): check the credentials and the bucket's permissions"
    else:
        fix = f"cannot be reached ({name}: {error}): check the URL, the endpoint (AWS_ENDPOINT_URL, ...) and network"
    for secret in _secrets(storage_options):
        fix = fix.replace(secret, "***")
    return f"{argument}={url!r}: {fix}."


def _bucket(fs: Any, url: str) -> str:
    """The bucket (container) a URL names: the first part of its path."""
    return str(fs._strip_protocol(url)).split("/", 1)[0]


def check_reachable(
    path: str, *, argument: str, storage_options: Mapping[str, Any] | None = None, expect: str = "file"
) -> dict[str, Any]:
    """Check a URL before any process starts: ``expect="file"``, a file to read (its fsspec ``info``, size
    included); ``expect="folder"``, the place a file will be written (its bucket exists, or its folder on a filesystem
    with folders). Each mistake is one :class:`StorageError` line naming ``argument``, the URL and the fix."""
    fs = filesystem(path, storage_options, argument=argument)
    try:
        if expect == "file":
            info = dict(fs.info(path))
            if info.get("type") != "file":
                raise StorageError(f"{argument}={path!r} is not a file: pass the URL of an existing file.")
            return info
        parent = fs._parent(path)
        place = _bucket(fs, path) if hasattr(fs, "split_path") else parent
        info = dict(fs.info(place))
        if info.get("type") != "directory":
            raise StorageError(f"{argument}={path!r}: {place} is not a folder or bucket; pass a URL inside one.")
        return info
    except StorageError:
        raise
    except FileNotFoundError:
        missing = path if expect == "file" else (_bucket(fs, path) if hasattr(fs, "split_path") else fs._parent(path))
        what = "no such file" if expect == "file" else f"{missing} does not exist (bucket or folder): create it first"
        raise StorageError(f"{argument}={path!r}: {what}.") from None
    except Exception as error:  # the provider's own errors (no credentials, denied, endpoint down)
        raise StorageError(_unreachable(path, argument, error, storage_options)) from None


@contextmanager
def open_input(path: str | Path, storage_options: Mapping[str, Any] | None = None) -> Iterator[IO[bytes]]:
    """A file opened for reading bytes, streamed from the store for a URL."""
    if not is_url(path):
        with Path(path).open("rb") as stream:
            yield stream
        return
    with filesystem(path, storage_options).open(str(path), "rb") as stream:
        yield stream


def read_text(path: str | Path, storage_options: Mapping[str, Any] | None = None) -> str:
    """A whole (small) text file, UTF-8, from a local path or a URL."""
    with open_input(path, storage_options) as stream:
        return stream.read().decode("utf-8")


@contextmanager
def local_file(path: str | Path, storage_options: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """A local path of the file ``path``: itself, or for a URL a private temporary copy, removed afterwards (for
    readers that need a path, such as flair's ``Model.load``)."""
    if not is_url(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="flair-fabric-download-") as folder:
        copy = Path(folder) / (Path(str(path)).name or "download")
        filesystem(path, storage_options).get_file(str(path), str(copy))
        yield copy


def write_atomically(
    path: str | Path, write: Callable[[str], None], storage_options: Mapping[str, Any] | None = None
) -> None:
    """``write(temporary)`` into a local temporary file, then made ``path`` whole: renamed into place for a local
    path (``flair_fabric.state.model_files.write_atomically``), uploaded in one piece for a URL. A reader never sees
    a half-written file; a failed write leaves nothing at ``path``."""
    if not is_url(path):
        from flair_fabric.state.model_files import write_atomically as write_locally

        write_locally(path, write)
        return
    fs = filesystem(path, storage_options)
    with tempfile.TemporaryDirectory(prefix="flair-fabric-upload-") as folder:
        temporary = os.path.join(folder, Path(str(path)).name or "upload")
        write(temporary)
        fs.put_file(temporary, str(path))


def storage_error(
    path: str, argument: str, error: BaseException, storage_options: Mapping[str, Any] | None = None
) -> StorageError:
    """A provider's error met while reading or writing ``path`` (no credentials, access denied, endpoint down) as one
    :class:`StorageError` line naming ``argument``, the URL and the fix; any credential in the cause is blanked."""
    if isinstance(error, FileNotFoundError):
        return StorageError(f"{argument}={path!r}: no such file.")
    return StorageError(_unreachable(path, argument, error, storage_options))
