"""Bad input is refused before any process starts, with an error that names the argument and the fix."""

from __future__ import annotations

import ast
import inspect
import signal
import sys
import types
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from flair.data import Corpus
from flair.datasets import FlairDatapointDataset
from flair.trainers import ModelTrainer

import flair_fabric
from flair_fabric import FabricLanguageModelTrainer, FabricTrainer, FlairDDPStrategy, FlairFSDPStrategy
from flair_fabric.launch import config as launch_module
from flair_fabric.launch.arguments import LightningArguments
from flair_fabric.launch.config import check_num_nodes, make_launch_config, resolve_devices, resolve_precision
from flair_fabric.strategies import deepspeed as deepspeed_module
from flair_fabric.training import progress_bar as progress_bar_module
from flair_fabric.training.arguments import TrainingOptions, split_added_arguments

from ..support import REPO, EventRecorder, no_training_may_start, small_trec, tiny_text_classifier


@pytest.fixture(scope="module")
def trainer() -> FabricTrainer:
    corpus = small_trec()
    return FabricTrainer(tiny_text_classifier(corpus), corpus)


BAD_ARGUMENTS = [
    ({"strategy": "dpp"}, r"strategy='dpp' is not supported; choose one of auto, ddp"),
    ({"strategy": object()}, r"strategy=<object object at .*> is not supported; choose one of auto, ddp, ddp_spawn"),
    ({"precision": "17"}, r"precision='17' is not supported here: Precision '17' is invalid. Allowed precision values"),
    ({"precision": "16"}, r"precision='16' needs a CUDA GPU; on cpu use precision='bf16-mixed'"),
    ({"precision": "16-mixed"}, r"precision='16-mixed' needs a CUDA GPU; on cpu use precision='bf16-mixed'"),
    ({"precision": "bf16-mixed", "use_amp": True}, r"use_amp=True and precision='bf16-mixed' were both given"),
    ({"devices": 0}, r"devices=0 is not valid: pass a positive number"),
    ({"devices": -3}, r"devices=-3 is not valid: pass a positive number of devices, -1 for all, or 'auto'"),
    ({"devices": [0, 1]}, r"devices=\[0, 1\] selects GPUs; on CPU devices is the number of processes"),
    ({"devices": -1}, r"devices=-1 selects GPUs"),
    ({"devices": "two"}, r"devices='two' is not valid: pass a positive int, -1, 'auto' or a list of indices"),
    ({"num_nodes": 0}, r"num_nodes=0 is not valid: pass the number of machines"),
    ({"num_nodes": 1.5}, r"num_nodes=1.5 is not valid: pass the number of machines, a positive int"),
    ({"accelerator": "tpu"}, r"accelerator='tpu' is not supported; choose one of auto, cpu, cuda"),
    ({"accelerator": "cuda", "devices": 2}, r"asks for more cuda devices than this machine has \(0\)"),
    ({"multi_gpu": True}, r"multi_gpu=True is flair's own multi-GPU mode.*pass devices=N"),
    ({"strategy": "fsdp", "precision": "64-true"}, r"strategy='fsdp' does not support precision='64-true'"),
    ({"strategy": FlairFSDPStrategy(cpu_offload=True), "devices": 2}, r"cpu_offload=True\) moves shards from the GPU"),
    (
        {"strategy": "fsdp", "devices": 2, "reduce_transformer_vocab": True},
        r"reduce_transformer_vocab=True .* cannot be combined with a sharded strategy",
    ),
    ({"strategy": "deepspeed_stage_3"}, r"strategy='deepspeed_stage_3' is not supported; choose one of"),
    ({"collective_timeout": 0}, r"collective_timeout=0 is not valid: pass a positive number of seconds"),
    ({"collective_timeout": "5m"}, r"collective_timeout='5m' is not valid: pass a positive number of seconds"),
    ({"collective_timeout": -1.5}, r"collective_timeout=-1.5 is not valid: pass a positive number of seconds"),
    ({"collective_timeout": True}, r"collective_timeout=True is not valid"),
    ({"collective_timeout": timedelta(seconds=-5)}, r"collective_timeout=datetime.timedelta\(days=-1, .* is not valid"),
    (
        {"collective_timeout": 30, "strategy": FlairDDPStrategy(), "devices": 2},
        r"collective_timeout=30 and a strategy object were both given: pass timeout= to the FlairDDPStrategy",
    ),
    (
        {"collective_timeout": 30, "strategy": FlairFSDPStrategy(), "devices": 2},
        r"collective_timeout=30 and a strategy object were both given: pass timeout= to the FlairFSDPStrategy",
    ),
    ({"balance_batches": "yes"}, r"balance_batches='yes' is not valid: pass True \(each step dealt by length\)"),
    # the rest of the README's table
    ({"progress_bar": "yes"}, r"progress_bar='yes' is not valid: pass True \(always\), False \(never\) or None"),
    ({"checkpoint_every_n_epochs": -1}, r"checkpoint_every_n_epochs=-1 is not valid: pass a whole number of 0 or more"),
    ({"checkpoint_every_n_steps": 0}, r"checkpoint_every_n_steps=0 is not valid: pass a whole number of 1 or more"),
    (
        {"checkpoint_every_n_minutes": 0},
        r"checkpoint_every_n_minutes=0 is not valid: pass a positive number of minutes",
    ),
    ({"keep_checkpoints": 0}, r"keep_checkpoints=0 is not valid: pass a whole number of 1 or more"),
    ({"requeue_signal": "SIGFOO"}, r"requeue_signal='SIGFOO' is not a signal: pass e.g. signal.SIGUSR1, 'SIGUSR1'"),
    (
        {"resume_from": str(REPO / "README.md")},
        r"resume_from='.*README.md' is not a flair-fabric checkpoint .*: pass a 'checkpoints/step-...' folder",
    ),
    ({"val_check_interval": 0}, r"val_check_interval=0 is not valid: pass a number of optimizer steps \(an int >= 1\)"),
    ({"mini_batch_chunk_size": 0}, r"mini_batch_chunk_size=0 is not valid: pass a positive number of data points"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS)
def test_bad_argument_is_refused_before_launch(
    trainer: FabricTrainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict[str, Any], message: str
) -> None:
    if arguments.get("accelerator") == "cuda" and launch_module.available_device_count("cuda"):
        pytest.skip("this machine has CUDA devices")
    no_training_may_start(monkeypatch)  # an argument that is not refused fails here, not in a run it starts
    arguments = {"accelerator": "cpu", **arguments}
    with pytest.raises(ValueError, match=message):
        trainer.train(tmp_path, max_epochs=1, **arguments)
    assert trainer.fabric is None, "no Fabric (and no process) may be started for bad input"
    assert not (tmp_path / "training.log").exists()


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True, "2", "AUTO", None])
def test_num_nodes_must_be_a_positive_int(num_nodes: Any) -> None:
    """README: num_nodes takes an int >= 1; anything else is refused by name, with the fix (the check on its own: a
    0 let through would fail later with another error, in a division by the number of machines)."""
    with pytest.raises(ValueError, match=r"num_nodes=.* is not valid: pass the number of machines, a positive int"):
        check_num_nodes(num_nodes)
    assert check_num_nodes(3) == 3 and check_num_nodes("auto") == "auto"


def test_more_gpus_than_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_module, "available_device_count", lambda accelerator: 2)
    with pytest.raises(ValueError, match=r"devices=4 asks for more cuda devices than this machine has \(2\)"):
        resolve_devices(4, "cuda")
    with pytest.raises(ValueError, match=r"asks for cuda device 3, but this machine has 2"):
        resolve_devices([0, 3], "cuda")
    assert resolve_devices(-1, "cuda") == 2
    assert resolve_devices("auto", "cuda") == 2
    assert resolve_devices("0,1", "cuda") == [0, 1]
    with pytest.raises(ValueError, match="names a device twice"):
        resolve_devices([0, 0], "cuda")


def test_devices_and_strategy_resolution_on_cpu() -> None:
    single = make_launch_config(
        accelerator="cpu", devices="auto", num_nodes=1, strategy="auto", precision=None, use_amp=False
    )
    assert (single.devices, single.strategy, single.precision, single.world_size) == (1, "auto", "32-true", 1)
    # flair's use_amp on a CPU is bfloat16 autocast: Fabric's bf16-mixed (16-mixed needs CUDA and is refused)
    two = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="auto", precision=None, use_amp=True)
    assert isinstance(two.strategy, FlairDDPStrategy) and two.precision == "bf16-mixed" and two.world_size == 2
    custom = FlairDDPStrategy(find_unused_parameters=True)
    assert make_launch_config(
        accelerator="cpu", devices="2", num_nodes=2, strategy=custom, precision="32-true", use_amp=False
    ) == launch_module.LaunchConfig("cpu", 2, 2, custom, "32-true")


class _FabricThatResolves:
    """Stands in for Fabric's connector where the machine has no CUDA or MPS device: the precision it is given is
    the one it resolves to."""

    def __init__(self, accelerator: str, devices: int, precision: str, plugins: list) -> None:
        self.strategy = types.SimpleNamespace(precision=types.SimpleNamespace(precision=precision))


def test_use_amp_means_16_mixed_on_cuda_and_bf16_mixed_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """README: flair's use_amp=True means "16-mixed" on CUDA (flair's own fp16 autocast), "bf16-mixed" elsewhere."""
    monkeypatch.setattr(launch_module, "Fabric", _FabricThatResolves)

    def mapped(accelerator: str) -> str:
        try:
            return resolve_precision(None, True, accelerator)
        except ValueError as refused:  # mapped to a precision the accelerator cannot run
            return f"refused: {refused}"

    assert {accelerator: mapped(accelerator) for accelerator in ("cuda", "mps", "cpu")} == {
        "cuda": "16-mixed",
        "mps": "bf16-mixed",
        "cpu": "bf16-mixed",
    }
    assert resolve_precision(None, False, "cuda") == "32-true", "without use_amp: Fabric's default"


def test_ddp_strategy_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"find_unused_parameters='sometimes' is not valid"):
        FlairDDPStrategy(find_unused_parameters="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"start_method='forkserver'\) is not valid: choose one of popen, spawn"):
        FlairDDPStrategy(start_method="forkserver")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("installed", "message"),
    [
        (False, r"strategy='deepspeed' needs the deepspeed package, which is not installed: pip install"),
        (True, r"strategy='deepspeed' needs a CUDA GPU, and the accelerator here is 'cpu': use strategy='fsdp'"),
    ],
)
def test_deepspeed_without_its_package_or_without_a_gpu(
    trainer: FabricTrainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool, message: str
) -> None:
    monkeypatch.setattr(deepspeed_module, "deepspeed_is_installed", lambda: installed)
    for strategy in ("deepspeed", "deepspeed_stage_2"):
        with pytest.raises(ValueError, match=message):
            trainer.train(tmp_path, max_epochs=1, accelerator="cpu", devices=2, strategy=strategy)
    assert trainer.fabric is None and not (tmp_path / "training.log").exists()


def test_fsdp_strategy_options_are_checked() -> None:
    fsdp = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="fsdp", precision=None, use_amp=True)
    assert isinstance(fsdp.strategy, FlairFSDPStrategy) and fsdp.precision == "bf16-mixed"
    assert fsdp.strategy.start_method == "popen" and fsdp.strategy.reshard_after_forward
    with pytest.raises(ValueError, match=r"start_method='forkserver'\) is not valid: choose one of popen, spawn"):
        FlairFSDPStrategy(start_method="forkserver")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"policy=3\) is not valid: pass a set of module classes or a function"):
        FlairFSDPStrategy(policy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'\) is not valid: pass a"):
        FlairFSDPStrategy(mixed_precision="bf16")  # type: ignore[arg-type]


def test_empty_and_too_small_train_splits(tmp_path: Path) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    empty = Corpus(FlairDatapointDataset([]), corpus.dev, corpus.test, sample_missing_splits=False)
    with pytest.raises(ValueError, match="the train split is empty"):
        FabricTrainer(model, empty).train(tmp_path, accelerator="cpu", devices=1)
    one = Corpus(FlairDatapointDataset([corpus.train[0]]), corpus.dev, corpus.test, sample_missing_splits=False)
    with pytest.raises(ValueError, match=r"1 data point\(s\) for 2 processes"):
        FabricTrainer(model, one).train(tmp_path, accelerator="cpu", devices=2, strategy="ddp_fork")


def _readme_arguments() -> dict[str, tuple[Any, str, str]]:
    """The README's argument table: name -> (default, accepted, meaning); the default is the first value shown."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            shown = cells[1].split("`")[1]
            default = signal.SIGUSR1 if shown == "signal.SIGUSR1" else ast.literal_eval(shown)
            rows[cells[0].strip("`")] = (default, cells[2], cells[3])
    return rows


def test_the_added_arguments_are_declared_once_and_the_readme_and_every_signature_show_them() -> None:
    """The README's table (the independent reference) lists exactly Lightning's and flair-fabric's arguments, with the
    defaults and texts of their one declaration; every entry point's signature shows those defaults, and what
    ``train_custom`` binds is those records (a name it does not know goes to flair, as in flair's trainer)."""
    readme = _readme_arguments()
    declared = [*fields(LightningArguments), *fields(TrainingOptions)]
    assert list(readme) == [each.name for each in declared]
    for each in declared:
        default, accepted, meaning = readme[each.name]
        assert default == each.default, each.name
        assert (accepted, meaning) == (each.metadata["accepted"], each.metadata["meaning"]), each.name
    lightning = {name: default for name, (default, _, _) in readme.items() if name in LightningArguments.names()}
    for method in (FabricTrainer.train, FabricTrainer.fine_tune, FabricTrainer.train_custom):
        shown = inspect.signature(method).parameters
        assert {name: shown[name].default for name in readme} == {name: row[0] for name, row in readme.items()}
    for entry in (FabricLanguageModelTrainer.train, flair_fabric.predict, flair_fabric.evaluate):
        shown = inspect.signature(entry).parameters
        assert {name: shown[name].default for name in lightning} == lightning, entry.__qualname__
    passed = {name: object() for name in readme}
    bound_lightning, bound_options, rest = split_added_arguments({**passed, "momentum": 0.9})
    assert {
        **bound_lightning.as_dict(),
        **{name: getattr(bound_options, name) for name in TrainingOptions.names()},
    } == passed
    assert rest == {"momentum": 0.9}, "the optimizer's arguments stay flair's"


def test_every_flair_argument_is_accepted_and_reaches_the_run(tmp_path: Path) -> None:
    """flair's own train_custom arguments, each passed by name with flair's default, reach the plugins as they do in
    flair's trainer; the signature shows them plus exactly the arguments listed in the README."""
    flair_parameters = {
        name: parameter.default
        for name, parameter in inspect.signature(ModelTrainer.train_custom).parameters.items()
        if name not in ("self", "base_path", "kwargs")
    }
    shown = inspect.signature(FabricTrainer.train_custom).parameters
    assert set(shown) - {"self", "base_path", "kwargs"} == set(flair_parameters) | set(_readme_arguments())
    setups = []
    for trainer_class, extra in ((ModelTrainer, {}), (FabricTrainer, {"accelerator": "cpu", "devices": 1})):
        corpus = small_trec()
        recorder = EventRecorder()
        passed = {**flair_parameters, "max_epochs": 1, "create_file_logs": False, "plugins": [recorder]}
        trainer_class(tiny_text_classifier(corpus), corpus).train_custom(tmp_path, **passed, **extra)
        setups.append(next(arguments for event, arguments in recorder.events if event == "after_setup"))
    flairs, ours = setups
    assert {name: ours[name] for name in flair_parameters} == {name: flairs[name] for name in flair_parameters}


@pytest.mark.parametrize(
    ("precision", "resolved"),
    [("bf16", "bf16-mixed"), (32, "32-true"), ("32", "32-true"), ("bf16-true", "bf16-true"), (64, "64-true")],
)
def test_fabrics_precision_aliases_are_accepted(precision: Any, resolved: str) -> None:
    config = make_launch_config(
        accelerator="cpu", devices=1, num_nodes=1, strategy="auto", precision=precision, use_amp=False
    )
    assert config.precision == resolved


@pytest.mark.parametrize(
    ("strategy", "given", "expected"),
    [
        ("ddp", None, timedelta(minutes=10)),
        ("ddp_fork", 42, timedelta(seconds=42)),
        ("fsdp", timedelta(seconds=7), timedelta(seconds=7)),
        (FlairDDPStrategy(), None, timedelta(minutes=10)),
        (FlairFSDPStrategy(), None, timedelta(minutes=10)),
        (FlairFSDPStrategy(timeout=timedelta(seconds=9)), None, timedelta(seconds=9)),
    ],
)
def test_collective_timeout_reaches_the_process_group(strategy: Any, given: Any, expected: timedelta) -> None:
    config = make_launch_config(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        precision=None,
        use_amp=False,
        collective_timeout=given,
    )
    assert config.collective_timeout == expected
    assert config.strategy._timeout == expected  # what Lightning passes to init_process_group


@pytest.mark.parametrize(
    ("terminal", "notebook", "drawn"),
    [(True, False, True), (False, True, True), (True, True, True), (False, False, False)],
)
def test_progress_bar_none_draws_in_a_terminal_or_a_notebook(
    monkeypatch: pytest.MonkeyPatch, terminal: bool, notebook: bool, drawn: bool
) -> None:
    """README / docs/notebooks.md: progress_bar=None (the default) shows the bar in a terminal or a notebook, and on
    global rank 0 only; a batch job's log (neither) stays free of bar lines."""
    monkeypatch.setattr(progress_bar_module, "in_jupyter_kernel", lambda: notebook)
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(isatty=lambda: terminal))
    assert progress_bar_module.show_progress_bar(None, is_global_zero=True) is drawn
    assert progress_bar_module.show_progress_bar(None, is_global_zero=False) is False
    for method in (FabricTrainer.train, FabricTrainer.fine_tune, FabricTrainer.train_custom):
        assert inspect.signature(method).parameters["progress_bar"].default is None
