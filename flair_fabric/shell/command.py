"""``python -m flair_fabric train CONFIG [CONFIG ...] [--key value ...]``: check the config, then train.

Everything is checked before any process starts or any data is read: the YAML, the keys and the trainer's values
(first pass, without torch or flair), a corpus's data folder that does not exist, then the classes and their arguments
(second pass), then a resume against the run's ``config.yaml``. The run is what this script would do::

    flair.set_seed(seed); corpus = Corpus(...); embeddings = Embeddings(...)
    model = Model(embeddings, <dictionary from the corpus>, ...)
    FabricTrainer(model, corpus).<method>(base_path, ..., plugins=[..., loggers])

It runs unchanged under ``torchrun`` and ``srun``, and with ``trainer.devices: N`` (each process runs the command).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from flair_fabric.shell.errors import ConfigError, check_yaml, config_files, explain, inlined, where
from flair_fabric.shell.options import PROG, all_keys, config_argv, make_parser, method_given

FOLDER_SUFFIXES = ("folder", "_dir", "_path")
PRINT_CONFIG = "--print_config"


def _parse(parser: Any, argv: Sequence[str], method: str, texts: Sequence[str] | None = None, **kwargs: Any) -> Any:
    """``texts``: ``argv`` with URL config files as their text (:func:`inlined`); messages name ``argv``'s files."""
    try:
        return parser.parse_args(list(argv if texts is None else texts), **kwargs)
    except argparse.ArgumentError as error:
        raise explain(str(error), argv, all_keys(method)) from None


def check_data_folders(corpus: Any, argv: Sequence[str]) -> None:
    """Refuse a corpus's data folder argument (``data_folder``, ``data_dir``, ``data_path``, ...) that does not
    exist: a local folder, or a URL (reached with the corpus's ``storage_options``)."""
    from flair_fabric.storage import StorageError, check_reachable, is_url

    init_args = (corpus or {}).get("init_args") or {}
    for name, value in init_args.items():
        is_data_folder = name.startswith("data") and name.endswith(FOLDER_SUFFIXES)
        if not (is_data_folder and isinstance(value, str)):
            continue
        key = f"corpus.init_args.{name}"
        if is_url(value):
            try:
                check_reachable(value, argument=key, storage_options=init_args.get("storage_options"), expect="folder")
            except StorageError as error:
                raise ConfigError(f"{where(key, argv)}: {error}") from None
        elif not Path(value).exists():
            raise ConfigError(
                f"{where(key, argv)}: {key}: {value}: no such folder; give the folder that holds the data."
            )


MLFLOW_CLASSES = (
    "flair_fabric.MLflowTracker",
    "flair_fabric.plugins.MLflowTracker",
    "flair_fabric.plugins.trackers.MLflowTracker",
    "lightning.pytorch.loggers.MLFlowLogger",
    "lightning.pytorch.loggers.mlflow.MLFlowLogger",
)


def check_tracker_stores(loggers: Any, argv: Sequence[str]) -> None:
    """Refuse an MLflow logger whose store MLflow will refuse (its file store without ``MLFLOW_ALLOW_FILE_STORE``),
    before torch or flair is imported: MLflow would fail at the first logged number, deep inside the run."""
    from flair_fabric.plugins.mlflow_store import mlflow_store_problem

    for index, logger in enumerate(loggers or []):
        if isinstance(logger, dict) and logger.get("class_path") in MLFLOW_CLASSES:
            problem = mlflow_store_problem((logger.get("init_args") or {}).get("tracking_uri"))
            if problem is not None:
                raise ConfigError(f"{where('loggers', argv)}: loggers[{index}].init_args.tracking_uri: {problem}")


def check_engine(engine: Any, argv: Sequence[str]) -> None:
    """``engine: ray`` needs Ray Train (the ``[ray]`` extra): refused before torch or flair is imported, naming it."""
    if engine != "ray":
        return
    from flair_fabric.launch.ray_train import RayNotInstalled, require_ray_train

    try:
        require_ray_train("engine: ray")
    except RayNotInstalled as missing:
        raise ConfigError(f"{where('engine', argv)}: {missing}") from None


def _class_help(argv: Sequence[str]) -> tuple[str, str] | None:
    """``("model", "flair.models.SequenceTagger")`` for ``--model.help flair.models.SequenceTagger``, else ``None``."""
    for index, each in enumerate(argv):
        name, _, value = each.partition("=")
        if name.startswith("--") and name.endswith(".help"):
            return name[2:-5], value or (argv[index + 1] if index + 1 < len(argv) else "")
    return None


def checked_config(argv: Sequence[str]) -> tuple[Any, Any, Any]:
    """The second-pass parser, the whole config and what the config gives, checked; before any data is read.

    With ``--print_config``: print the resolved config (what ``config.yaml`` will hold) and end (``SystemExit``)."""
    argv = config_argv(argv)
    check_yaml(config_files(argv))
    method = method_given(argv)
    print_config = PRINT_CONFIG in argv
    argv = [each for each in argv if each != PRINT_CONFIG]
    texts = inlined(argv)  # each URL config file read once, through flair_fabric.storage
    helped = _class_help(argv)
    if helped is not None:  # `--model.help CLASS`: jsonargparse's help of a class, from the second pass
        first = Namespace(**{helped[0]: {"class_path": helped[1]}})
    else:
        first = _parse(make_parser(method), argv, method, texts)
        check_data_folders(first.get("corpus"), argv)
        check_tracker_stores(first.get("loggers"), argv)
        check_engine(first.get("engine"), argv)

    from flair_fabric.shell.components import second_pass_parser  # torch, flair and Lightning load here
    from flair_fabric.shell.record import resolved_config

    parser = second_pass_parser(method, first)
    config = _parse(parser, argv, method, texts)
    given = _parse(parser, argv, method, texts, defaults=False)
    if print_config:
        print(resolved_config(parser, config, given), end="")
        raise SystemExit(0)
    return parser, config, given


def train(argv: Sequence[str]) -> dict:
    """Check the config, make what it describes and train; returns flair's result."""
    parser, config, given = checked_config(argv)
    from flair_fabric.launch.ray_train import ray_train_context

    if config.engine == "ray" and ray_train_context() is None:  # here: submit; in Ray's workers: train
        from flair_fabric.shell.ray_submit import submit

        return submit(list(argv), config.ray, command=train)
    from flair_fabric import FabricTrainer, LightningLoggerPlugin
    from flair_fabric.launch.environment import restarted_by_torchrun
    from flair_fabric.shell.components import make_components
    from flair_fabric.shell.record import ConfigRecordPlugin, check_resume, flattened, resolved_config

    resolved = resolved_config(parser, config, given)
    if config.trainer.resume_from is not None or restarted_by_torchrun():
        check_resume(config.trainer.base_path, resolved, config.trainer.storage_options)
    made = make_components(parser, config, given)
    plugins = list(made.trainer_arguments.pop("plugins", None) or [])
    plugins.append(ConfigRecordPlugin(resolved))
    if made.loggers:
        import yaml

        plugins.append(LightningLoggerPlugin(made.loggers, hyperparameters=flattened(yaml.safe_load(resolved))))
    trainer = FabricTrainer(made.model, made.corpus)
    return getattr(trainer, made.method)(**made.trainer_arguments, plugins=plugins)


def main(argv: Sequence[str]) -> int:
    """The ``train`` command; a config mistake ends it with the message and exit code 2."""
    if not argv:
        print(f"usage: {PROG} CONFIG [CONFIG ...] [--key value ...]  ({PROG} --help: every key)", file=sys.stderr)
        return 2
    try:
        train(argv)
    except ConfigError as error:
        print(f"python -m flair_fabric train: {error}", file=sys.stderr)
        return 2
    return 0
