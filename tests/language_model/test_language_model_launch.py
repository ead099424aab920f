"""What FabricLanguageModelTrainer.train hands to the launch, without starting any process: flair's arguments and
defaults, the launch arguments as FabricTrainer checks them, use_amp, resume_from, torchrun restarts, and text too
short for the columns of the whole run."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.fabric.accelerators.cuda as lightning_cuda
import pytest
import torch
from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus
from lightning.fabric import Fabric
from lightning.fabric.accelerators import CUDAAccelerator
from lightning.fabric.strategies import DeepSpeedStrategy

from flair_fabric import FabricLanguageModelTrainer, FabricTrainer
from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.job import LanguageModelJob
from flair_fabric.launch.config import LaunchConfig, build_fabric
from flair_fabric.state.training_state import complete_checkpoints

from .lm_support import (
    LM_OPTIONS,
    character_dictionary,
    language_model_trainer,
    no_process_may_start,
    tiny_corpus,
    tiny_language_model,
    write_tiny_corpus,
)

LAUNCH_ARGUMENTS = ("accelerator", "devices", "num_nodes", "strategy", "precision", "resume_from", "collective_timeout")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TextCorpus:
    return tiny_corpus(tmp_path_factory.mktemp("lm-corpus"))


@dataclass
class _Launch:
    fabric: Fabric
    arguments: LanguageModelArguments
    timeout: timedelta


def _launch_of(monkeypatch: pytest.MonkeyPatch, trainer: FabricLanguageModelTrainer, **options: Any) -> _Launch:
    """``trainer.train(**options)`` up to the start of the ranks: the Fabric, arguments and timeout it would run."""
    launched: list[_Launch] = []

    def start(job: LanguageModelJob, launch: LaunchConfig) -> None:
        launched.append(_Launch(build_fabric(launch), job.arguments, launch.collective_timeout))

    monkeypatch.setattr(language_model_trainer, "run_job", start)
    try:
        trainer.train(**options)
    except ValueError as error:
        pytest.fail(f"train({options}) was refused: {error}")
    assert len(launched) == 1, "one launch"
    return launched[0]


@pytest.fixture(scope="module")
def earlier_run(corpus: TextCorpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run with ``checkpoint=True``: its checkpoints (one after each split) in ``checkpoints/``."""
    run = tmp_path_factory.mktemp("earlier")
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(run, checkpoint=True, **options)
    return run


def test_train_takes_flairs_arguments_with_flairs_defaults() -> None:
    """Every argument of flair's LanguageModelTrainer.train keeps its name, place, kind and default; the added
    launch arguments are keyword-only, with FabricTrainer's defaults."""
    flairs = inspect.signature(LanguageModelTrainer.train).parameters
    ours = inspect.signature(FabricLanguageModelTrainer.train).parameters
    positional = [name for name, parameter in ours.items() if parameter.kind is parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [name for name, p in flairs.items() if p.kind is p.POSITIONAL_OR_KEYWORD], "same order"
    for name, parameter in flairs.items():
        assert name in ours, f"flair's {name} is missing"
        assert ours[name].kind == parameter.kind, name
        assert ours[name].default == parameter.default, f"{name}: {ours[name].default!r}, flair's {parameter.default!r}"
    fabric_trainers = inspect.signature(FabricTrainer.train_custom).parameters
    for name in LAUNCH_ARGUMENTS:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert ours[name].default == fabric_trainers[name].default, name


def test_collective_timeout_and_the_launch_arguments_reach_the_launch(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """collective_timeout (seconds or a timedelta) is the timeout of the launch and of DDP's process group, as for
    FabricTrainer; devices, num_nodes and strategy give the Fabric that starts the ranks (and the columns of the
    run)."""
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    options = {**LM_OPTIONS, "base_path": tmp_path, "mini_batch_size": 2, "accelerator": "cpu"}
    for timeout in (45, timedelta(minutes=3)):
        launch = _launch_of(monkeypatch, trainer, **options, devices=2, strategy="ddp_fork", collective_timeout=timeout)
        expected = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        assert launch.timeout == expected, "the launch's timeout"
        assert launch.arguments.launch.collective_timeout == expected
        assert launch.fabric.strategy._timeout == expected, "DDP's process group"  # type: ignore[attr-defined]
        assert launch.fabric.world_size == 2 and launch.fabric.strategy.launcher._start_method == "fork"  # type: ignore[attr-defined]
    nodes = _launch_of(monkeypatch, trainer, **options, devices=2, num_nodes=2, strategy="ddp_fork")
    assert nodes.arguments.launch.num_nodes == 2, "num_nodes reaches the launch"
    assert nodes.fabric.world_size == 4 and nodes.arguments.global_batch == 8, "2 machines x 2 processes x 2 columns"


def test_use_amp_trains_in_fabrics_mixed_precision_as_flairs_autocast_does(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """use_amp=True (flair's autocast, bfloat16 on a CPU) goes to Fabric as precision 'bf16-mixed' on a CPU, as for
    FabricTrainer; without it the run is 32-true."""
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16, "what flair's torch.autocast uses on a CPU"
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    options = {**LM_OPTIONS, "base_path": tmp_path, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    amp = _launch_of(monkeypatch, trainer, **options, use_amp=True)
    assert amp.arguments.launch.precision == "bf16-mixed"
    assert amp.fabric.strategy.precision.precision == "bf16-mixed"  # type: ignore[attr-defined]
    plain = _launch_of(monkeypatch, trainer, **options)
    assert plain.fabric.strategy.precision.precision == "32-true"  # type: ignore[attr-defined]


def _one_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has one CUDA device, as Lightning and flair-fabric see it (nothing may run on it: only the launch
    is resolved)."""
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "auto_device_count", staticmethod(lambda: 1))
    monkeypatch.setattr(lightning_cuda, "_get_all_visible_cuda_devices", lambda: [0])
    monkeypatch.setattr(lightning_cuda, "num_cuda_devices", lambda: 1)


def test_on_a_cuda_device_use_amp_is_16_mixed_and_16_true_is_refused(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA device use_amp=True goes to Fabric as precision '16-mixed' (flair's autocast there is float16), as
    for FabricTrainer; precision='16-true', which casts the whole model, is refused before any process starts with
    the fix (a CUDA device as Lightning sees it; the launch is resolved, nothing runs)."""
    _one_cuda_device(monkeypatch)
    launched: list[LaunchConfig] = []
    monkeypatch.setattr(language_model_trainer, "run_job", lambda job, launch: launched.append(launch))
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    options = {**LM_OPTIONS, "base_path": tmp_path, "mini_batch_size": 2, "accelerator": "cuda", "devices": 1}
    trainer.train(**options, use_amp=True)
    assert [launch.precision for launch in launched] == ["16-mixed"]
    no_process_may_start(monkeypatch)
    fix = r"pass precision='32-true', 'bf16-mixed' or, on a GPU, '16-mixed'"
    with pytest.raises(ValueError, match=r"precision='16-true' \(16-true\) casts the whole model.*" + fix):
        trainer.train(**options, precision="16-true")


def test_a_deepspeed_launch_is_refused_before_any_process_starts(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the deepspeed package is installed (not here: there strategy='deepspeed' is refused for that, see
    test_bad_input_is_refused_before_any_process_starts), the launch resolves to Lightning's DeepSpeedStrategy, which
    the language-model trainer refuses, naming the DDP family (the launch made so here)."""
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # not set up: the package is not installed
    make_launch_config = language_model_trainer.make_launch_config

    def resolved_to_deepspeed(**arguments: Any) -> LaunchConfig:
        return dataclasses.replace(make_launch_config(**{**arguments, "strategy": "ddp_fork"}), strategy=deepspeed)

    monkeypatch.setattr(language_model_trainer, "make_launch_config", resolved_to_deepspeed)
    no_process_may_start(monkeypatch)
    options = {**LM_OPTIONS, "mini_batch_size": 2, "accelerator": "cpu", "devices": 2}
    with pytest.raises(ValueError, match=r"strategy='deepspeed': FabricLanguageModelTrainer trains with DDP"):
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(tmp_path, strategy="deepspeed", **options)


def test_resume_from_takes_auto_a_run_folder_or_a_checkpoint_folder(
    corpus: TextCorpus, earlier_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume_from='auto' takes the run's own newest checkpoint if there is one (else starts afresh); a run folder or
    its checkpoints folder means the newest checkpoint in it; a checkpoint folder is taken as it is."""
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    base = tmp_path / "run"
    newest = complete_checkpoints(earlier_run)[-1]
    assert len(complete_checkpoints(earlier_run)) == 1, "one kept, the newest (after the last split)"
    options = {**LM_OPTIONS, "base_path": base, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    assert _launch_of(monkeypatch, trainer, **options, resume_from="auto").arguments.resume_folder is None
    assert _launch_of(monkeypatch, trainer, **options).arguments.resume_folder is None
    for named in (earlier_run, str(earlier_run), earlier_run / "checkpoints", newest, str(newest)):
        resumed = _launch_of(monkeypatch, trainer, **options, resume_from=named).arguments.resume_folder
        assert resumed is not None and resumed.resolve() == newest.resolve(), named
    shutil.copytree(earlier_run / "checkpoints", base / "checkpoints")
    own = _launch_of(monkeypatch, trainer, **options, resume_from="auto").arguments.resume_folder
    assert own is not None and own.resolve() == (base / "checkpoints" / newest.name).resolve()


def test_a_job_restarted_by_torchrun_resumes_by_itself(
    corpus: TextCorpus, earlier_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT > 0), a run without resume_from continues
    from its own newest checkpoint; a first start (or a restart before any checkpoint was written) starts afresh."""
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    options = {**LM_OPTIONS, "base_path": tmp_path, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _launch_of(monkeypatch, trainer, **options).arguments.resume_folder is None, "no checkpoint yet"
    shutil.copytree(earlier_run / "checkpoints", tmp_path / "checkpoints")
    for restarts in ("1", "3"):  # the first restart, and a later one
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        resumed = _launch_of(monkeypatch, trainer, **options).arguments.resume_folder
        assert resumed is not None and resumed.parent.resolve() == (tmp_path / "checkpoints").resolve(), restarts
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _launch_of(monkeypatch, trainer, **options).arguments.resume_folder is None, "the first start"


def _corpus_with_a_short_file(folder: Path, short: str, characters: int, accented: bool = False) -> TextCorpus:
    """:func:`tiny_corpus` (held-out splits of 1200 characters, train splits of 3000) with ``short`` cut to its
    first ``characters`` characters (the last a line end); ``accented``: all of them "é" instead (two bytes each in
    UTF-8: the file has nearly twice as many bytes as characters)."""
    write_tiny_corpus(folder)
    path = folder / short
    text = path.read_text(encoding="utf-8")[: characters - 1] + "\n"  # flair ends every line with one
    if accented:
        text = "é" * (characters - 1) + "\n"
    assert len(text) == characters and len(text.encode("utf-8")) == (2 * characters - 1 if accented else characters)
    path.write_text(text, encoding="utf-8")
    return TextCorpus(folder, character_dictionary(folder), forward=True, character_level=True)


SHORT = [
    ("valid.txt", r"the validation split \(valid.txt\) has 300 characters", False),
    ("test.txt", r"the test split \(test.txt\) has 300 characters", False),
    ("train/train_split_2", r"the train split \S+train_split_2 has 300 characters", False),
    ("train/train_split_2", r"the train split \S+train_split_2 has 300 characters", True),  # 599 bytes
]


@pytest.mark.parametrize(("short", "message", "accented"), SHORT)
def test_text_shorter_than_two_characters_per_column_of_the_run_is_refused_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: str, message: str, accented: bool
) -> None:
    """2 processes x mini_batch_size 100 are 200 columns: a split (or split file) of 300 characters is refused
    before a Fabric is built or a process started (it has enough for the 100 columns of one process), with the
    arguments and the fix; characters are counted, not bytes (a split file of 300 "é" has 599 bytes)."""
    corpus = _corpus_with_a_short_file(tmp_path / "corpus", short, 300, accented)
    no_process_may_start(monkeypatch)
    fix = r": with mini_batch_size=100 on 2 process\(es\) it needs at least 400 \(two per column\); use a smaller"
    options = {**LM_OPTIONS, "mini_batch_size": 100, "accelerator": "cpu", "devices": 2, "strategy": "ddp_fork"}
    with pytest.raises(ValueError, match=message + fix):
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(tmp_path / "run", **options)


@pytest.mark.parametrize(("short", "accented"), [(short, accented) for short, _, accented in SHORT])
def test_two_characters_per_column_of_the_run_are_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: str, accented: bool
) -> None:
    """400 characters fill the 200 columns of 2 processes x mini_batch_size 100 twice: the run starts."""
    corpus = _corpus_with_a_short_file(tmp_path / "corpus", short, 400, accented)
    trainer = FabricLanguageModelTrainer(tiny_language_model(corpus), corpus)
    options = {**LM_OPTIONS, "mini_batch_size": 100, "accelerator": "cpu", "devices": 2, "strategy": "ddp_fork"}
    assert _launch_of(monkeypatch, trainer, base_path=tmp_path / "run", **options).fabric.world_size == 2
