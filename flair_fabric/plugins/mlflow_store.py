"""Where an :class:`~flair_fabric.plugins.trackers.MLflowTracker` logs, and whether MLflow will accept it, checked
before training starts (MLflow itself refuses only when the first number is logged, deep inside the run).

MLflow 3.13 and later refuse the file store (a ``file:`` URI or a plain path; ``mlflow/store/tracking/file_store.py``,
``FileStore.__init__``) unless ``MLFLOW_ALLOW_FILE_STORE`` is true in the environment. The check asks MLflow's own
``FileStore`` (made in a temporary folder, never the user's), so it holds for whichever MLflow is installed, and it
sets nothing for the user. It imports neither torch nor Lightning: the ``train`` command's first pass may call it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_TRACKING_URI = "file:./mlruns"
"""Where a tracker without ``tracking_uri`` (and without ``MLFLOW_TRACKING_URI``) logs: Lightning's
``MLFlowLogger`` default."""

FILE_STORE_SCHEMES = ("", "file")
"""The URI schemes MLflow serves with its file store (``_register_tracking_stores``: ``""`` and ``"file"``)."""


def tracking_uri_used(tracking_uri: str | None) -> str:
    """The URI an MLflow tracker logs to: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else ``file:./mlruns``."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def _refusal_of_file_store() -> str | None:
    """MLflow's own error when it refuses to make a file store in this environment, else ``None``."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.tracking.file_store import FileStore

    probe = Path(tempfile.mkdtemp(prefix="flair-fabric-mlflow-"))
    try:
        FileStore(str(probe / "mlruns"))
    except (MlflowException, ValueError) as error:  # ValueError: MLflow's reading of a malformed variable
        return str(error)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def file_store_variable() -> str:
    """The name of MLflow's switch for its file store, as MLflow spells it."""
    from mlflow import environment_variables

    variable = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return variable.name if variable is not None else "MLFLOW_ALLOW_FILE_STORE"


def mlflow_store_problem(tracking_uri: str | None) -> str | None:
    """Why MLflow will refuse to log to ``tracking_uri`` (given as ``MLflowTracker(tracking_uri=...)`` takes it),
    naming what to set; ``None`` where it will not refuse (or MLflow is not installed: the tracker names the extra
    when it is first used)."""
    uri = tracking_uri_used(tracking_uri)
    try:
        from mlflow.utils.uri import get_uri_scheme
    except ImportError:
        return None
    if get_uri_scheme(uri) not in FILE_STORE_SCHEMES:
        return None
    refusal = _refusal_of_file_store()
    if refusal is None:
        return None
    import mlflow

    variable = file_store_variable()
    given = "" if tracking_uri else " (from MLFLOW_TRACKING_URI)" if os.environ.get("MLFLOW_TRACKING_URI") else ""
    return (
        f"MLflowTracker(tracking_uri={tracking_uri!r}){given} logs to {uri!r}, MLflow's file store, which MLflow"
        f" {mlflow.__version__} refuses unless {variable}=true is set in the environment of every process of the job"
        f" (checked before training; MLflow would fail at the first logged number). Set {variable}=true (e.g."
        f" `export {variable}=true` before starting the job), or log to a tracking server (tracking_uri='http://...')"
        f" or a database (tracking_uri='sqlite:///mlflow.db', which needs SQLAlchemy). MLflow says: {refusal}"
    )


def check_mlflow_store(tracking_uri: str | None) -> None:
    """Raise a ``ValueError`` naming the fix where MLflow will refuse to log to ``tracking_uri``."""
    problem = mlflow_store_problem(tracking_uri)
    if problem is not None:
        raise ValueError(problem)
