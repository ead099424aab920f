"""The sharded strategies in one process: what FlairFSDPStrategy's knobs hand to ``fully_shard``, the caller's model
while its copy trains, and the refusals of docs/sharded-training.md, made before any process starts."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import ReduceTransformerVocabPlugin
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.fabric.strategies import DeepSpeedStrategy
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric import trainer as trainer_module
from flair_fabric.launch.config import make_launch_config
from flair_fabric.strategies import check_strategy, resolve_strategy, training_strategy
from flair_fabric.strategies import deepspeed as deepspeed_module
from flair_fabric.strategies import fsdp as fsdp_module
from flair_fabric.strategies.fsdp import ShardedCopy, check_fsdp_launch

from ..support import FABRIC_PRECISIONS, make_tiny_bert, small_trec, tiny_text_classifier, tiny_transformer_classifier


class _Mesh:
    """Stands in for the device mesh ``_shard`` is given (no process group in this process)."""

    data_parallel = object()

    def __getitem__(self, name: str) -> object:
        assert name == "data_parallel"
        return self.data_parallel

    def size(self) -> int:
        return 2


def _shard_calls(
    monkeypatch: pytest.MonkeyPatch, strategy: FlairFSDPStrategy, model: TextClassifier
) -> list[tuple[str, dict[str, Any]]]:
    """``strategy._shard(model, mesh)`` with ``fully_shard`` recorded: (module name, options) per call."""
    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(fsdp_module, "fully_shard", lambda module, **options: calls.append((module, options)))
    monkeypatch.setattr(fsdp_module, "register_fsdp_forward_method", lambda module, name: None)
    strategy._shard(model, _Mesh())  # type: ignore[arg-type]
    names = {id(module): name for name, module in model.named_modules()}
    return [(names[id(module)], options) for module, options in calls]


def _classifier() -> TextClassifier:
    return tiny_text_classifier(small_trec())


@pytest.mark.parametrize("kind", ["set of classes", "set of two classes", "function", "another function"])
def test_the_policy_is_a_set_of_module_classes_or_a_function_and_decides_the_shard_units(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """policy={Linear} and policy=lambda m: isinstance(m, Linear) make exactly the Linear layers shard units (the
    whole model is the root unit, sharded last); {Linear, DocumentPoolEmbeddings} adds the document embedding; a
    function that picks the decoder makes it the only unit."""
    model = _classifier()
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert len(linear) == 3  # the pooling embedding's two maps and the decoder
    policies: dict[str, Any] = {
        "set of classes": ({torch.nn.Linear}, linear),
        "set of two classes": ({torch.nn.Linear, DocumentPoolEmbeddings}, [*linear, "embeddings"]),
        "function": (lambda module: isinstance(module, torch.nn.Linear), linear),
        "another function": (lambda module: module is model.decoder, ["decoder"]),
    }
    policy, expected = policies[kind]
    calls = _shard_calls(monkeypatch, FlairFSDPStrategy(policy=policy), model)
    assert sorted(name for name, _ in calls[:-1]) == sorted(expected)
    assert calls[-1][0] == "", "the whole model is sharded last, as the root unit"


def test_the_default_policy_makes_each_transformer_layer_a_shard_unit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """strategy="fsdp" (no policy) on a tiny-BERT classifier: BertEmbeddings and each BertLayer (the classes BERT
    lists in _no_split_modules) are the shard units; the whole model is the root unit, sharded last."""
    corpus = small_trec(train_size=12, dev_size=2, test_size=2)
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    names = [name for name, _ in _shard_calls(monkeypatch, FlairFSDPStrategy(), model)]
    assert sorted(names[:-1]) == [
        "embeddings.model.embeddings",
        "embeddings.model.encoder.layer.0",
        "embeddings.model.encoder.layer.1",
    ]
    assert names[-1] == "", "the root unit"


def test_fsdp_shards_over_every_process_of_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes of 2 processes: one data-parallel mesh dimension of 4 (each rank holds a quarter), no other axis."""
    from lightning.fabric.strategies import ModelParallelStrategy

    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: None)  # no process group here
    strategy = FlairFSDPStrategy()
    strategy.num_nodes = 2
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.setup_environment()
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)


FSDP_ACCEPTS = {"32-true", "bf16-mixed", "bf16-true", "16-true"}


def _fsdp_refuses(accelerator: str, precision: str) -> bool:
    """Whether the checks made before any process starts refuse ``precision`` under strategy='fsdp'."""
    try:
        check_fsdp_launch(FlairFSDPStrategy(), accelerator, precision)
    except ValueError as error:
        assert "strategy='fsdp' does not support precision" in str(error)
        return True
    return False


@pytest.mark.parametrize("precision", FABRIC_PRECISIONS, ids=str)
def test_fsdp_accepts_its_four_precisions_and_refuses_every_other(precision: Any) -> None:
    """Every spelling of a precision Fabric takes, in Fabric's own name for it: on CUDA the FSDP check accepts
    32-true, bf16-mixed, bf16-true and 16-true and refuses the rest (16-mixed, 64-true, transformer-engine)."""
    named = str(_convert_precision_to_unified_args(precision))
    assert _fsdp_refuses("cuda", named) == (named not in FSDP_ACCEPTS), named


def test_fsdp_precisions_on_cpu_before_any_process_starts() -> None:
    """On CPU the launch (every check made before any process starts) takes fsdp with 32-true, bf16-mixed and
    bf16-true; 16-true needs a CUDA GPU here as under every strategy, and 64-true is FSDP's refusal."""
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        try:
            launch = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="fsdp", precision=precision)
        except ValueError as error:
            pytest.fail(f"strategy='fsdp' with precision={precision!r} was refused on CPU: {error}")
        assert launch.precision == precision and isinstance(launch.strategy, FlairFSDPStrategy)
    with pytest.raises(ValueError, match=r"precision='16-true' needs a CUDA GPU"):
        make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="fsdp", precision="16-true")
    with pytest.raises(ValueError, match=r"strategy='fsdp' does not support precision='64-true'"):
        make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy="fsdp", precision="64-true")


def test_the_knobs_reach_fully_shard_for_every_shard_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """reshard_after_forward, cpu_offload and mixed_precision are what each unit's fully_shard call is given."""
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = FlairFSDPStrategy(
        policy={torch.nn.Linear}, reshard_after_forward=False, cpu_offload=True, mixed_precision=precision
    )
    calls = _shard_calls(monkeypatch, strategy, _classifier())
    units = calls[:-1]
    assert len(units) == 3
    for name, options in units:
        assert options["reshard_after_forward"] is False, name
        assert isinstance(options["offload_policy"], CPUOffloadPolicy), name
        assert options["mp_policy"] is precision, name
        assert options["mesh"] is _Mesh.data_parallel, name
    root = calls[-1][1]
    assert isinstance(root.get("offload_policy"), CPUOffloadPolicy) and root.get("mp_policy") is precision, root

    defaults = _shard_calls(monkeypatch, FlairFSDPStrategy(policy={torch.nn.Linear}), _classifier())[:-1]
    for name, options in defaults:  # least memory, no offload, no mixed precision policy of its own
        assert options["reshard_after_forward"] is True, name
        assert not isinstance(options["offload_policy"], CPUOffloadPolicy), name
        assert options.get("mp_policy") is None, name


def test_the_callers_model_holds_no_weights_while_its_copy_trains() -> None:
    """While the sharded copy trains, the caller's parameters sit on the meta device; the copy holds the weights."""
    model = _classifier()
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    copy = ShardedCopy(model)
    assert all(parameter.is_meta for parameter in model.parameters())
    working = dict(copy.working_model.named_parameters())
    assert not any(parameter.is_meta for parameter in working.values())
    assert all(torch.equal(working[name], weights[name]) for name in weights)


# --- refused before any process starts ----------------------------------------------------------------------------


@pytest.fixture
def no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the processes fails the test (instead of relaunching or forking anything)."""

    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail("a process was started: the run should have been refused before")

    monkeypatch.setattr(trainer_module, "run_job", started)


@pytest.mark.usefixtures("no_process_may_start")
@pytest.mark.parametrize("strategy", ["fsdp", "forked"])
@pytest.mark.parametrize("how", ["argument", "plugin"])
def test_fsdp_refuses_the_vocabulary_reduction_before_any_process_starts(
    tmp_path: Path, strategy: str, how: str
) -> None:
    corpus = small_trec()
    chosen = FlairFSDPStrategy(start_method="fork") if strategy == "forked" else strategy
    vocabulary = (
        {"reduce_transformer_vocab": True}
        if how == "argument"
        else {"plugins": [ReduceTransformerVocabPlugin(tmp_path, save_optimizer_state=False)]}
    )
    with pytest.raises(ValueError, match=r"reduce_transformer_vocab=True .* cannot be combined with a sharded"):
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(
            tmp_path, max_epochs=1, accelerator="cpu", devices=2, strategy=chosen, **vocabulary
        )


@pytest.mark.usefixtures("no_process_may_start")
def test_fsdp_refuses_cpu_offload_on_cpu_before_any_process_starts(tmp_path: Path) -> None:
    corpus = small_trec()
    strategy = FlairFSDPStrategy(cpu_offload=True, start_method="fork")
    with pytest.raises(ValueError, match=r"cpu_offload=True\) moves shards from the GPU to the CPU"):
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(
            tmp_path, max_epochs=1, accelerator="cpu", devices=2, strategy=strategy
        )
    for accelerator in ("cpu", "mps"):
        with pytest.raises(ValueError, match=f"the accelerator is '{accelerator}'"):
            check_fsdp_launch(FlairFSDPStrategy(cpu_offload=True), accelerator, "32-true")
    check_fsdp_launch(FlairFSDPStrategy(cpu_offload=True), "cuda", "32-true")  # GPU runs may offload


def _deepspeed(config: dict | None) -> DeepSpeedStrategy:
    """A DeepSpeedStrategy object with ``config`` (Lightning's constructor needs the deepspeed package)."""
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = config
    return strategy


@pytest.mark.parametrize("stage", [3, 4])
def test_deepspeed_beyond_stage_2_is_refused(monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """Stage 3 (or anything past 2) is refused by the checks made before any process starts, even where DeepSpeed
    is installed and a GPU is there; stages 1 and 2 (and no ZeRO) pass."""
    monkeypatch.setattr(deepspeed_module, "deepspeed_is_installed", lambda: True)
    with pytest.raises(ValueError, match=f"ZeRO stage {stage} is not supported"):
        check_strategy(_deepspeed({"zero_optimization": {"stage": stage}}), "cuda", "32-true")
    for allowed in (0, 1, 2):
        check_strategy(_deepspeed({"zero_optimization": {"stage": allowed}}), "cuda", "32-true")
    check_strategy(_deepspeed(None), "cuda", "32-true")


def test_a_deepspeed_strategy_object_needs_a_gpu_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Your own DeepSpeedStrategy (stage 2) object: refused on CPU even where the package is installed, and without
    the package even on CUDA."""
    strategy = _deepspeed({"zero_optimization": {"stage": 2}})
    monkeypatch.setattr(deepspeed_module, "deepspeed_is_installed", lambda: True)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        check_strategy(strategy, "cpu", "32-true")
    check_strategy(strategy, "cuda", "32-true")
    monkeypatch.setattr(deepspeed_module, "deepspeed_is_installed", lambda: False)
    with pytest.raises(ValueError, match="deepspeed"):
        check_strategy(strategy, "cuda", "32-true")


def test_deepspeed_refuses_mini_batch_chunk_size_and_the_vocabulary_reduction() -> None:
    run_checks = training_strategy(_deepspeed({"zero_optimization": {"stage": 2}}))
    for chunk_size in (2, "auto"):
        with pytest.raises(ValueError, match="mini_batch_chunk_size cannot be used with strategy='deepspeed'"):
            run_checks.check_run(reduces_vocabulary=False, mini_batch_chunk_size=chunk_size)
    with pytest.raises(ValueError, match="reduce_transformer_vocab=True"):
        run_checks.check_run(reduces_vocabulary=True, mini_batch_chunk_size=None)
    run_checks.check_run(reduces_vocabulary=False, mini_batch_chunk_size=None)


@pytest.mark.parametrize(("name", "stage"), [("deepspeed", 2), ("deepspeed_stage_2", 2), ("deepspeed_stage_1", 1)])
def test_the_deepspeed_names_mean_fabrics_deepspeed_strategy_with_their_zero_stage(
    monkeypatch: pytest.MonkeyPatch, name: str, stage: int
) -> None:
    """strategy='deepspeed' is ZeRO stage 2 through Fabric's DeepSpeedStrategy (no package needed to check)."""
    built: list[dict[str, Any]] = []
    checked: list[str] = []

    def recorded(self: Any, **kwargs: Any) -> None:
        built.append(kwargs)

    monkeypatch.setattr(deepspeed_module, "require_deepspeed", checked.append)
    monkeypatch.setattr(deepspeed_module.FlairDeepSpeedStrategy, "__init__", recorded)
    timeout = timedelta(minutes=3)
    resolved = resolve_strategy(
        name, world_size=2, accelerator="cuda", launched=False, interactive=False, timeout=timeout
    )
    assert isinstance(resolved, DeepSpeedStrategy), "Fabric's DeepSpeedStrategy (flair-fabric's subclass of it)"
    assert built == [{"stage": stage, "timeout": timeout}]
    assert checked == ["cuda"], "the package and the GPU are checked first"
