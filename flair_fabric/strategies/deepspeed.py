"""DeepSpeed (ZeRO stage 1 or 2, CUDA only) through Fabric's ``DeepSpeedStrategy``: its checks and its part in the
loop. Model and optimizer are set up together, and the engine clips gradients itself (from its config). Stage 3
partitions the parameters, so flair could neither predict nor save with them: refused."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import flair
from lightning.fabric import Fabric
from lightning.fabric.strategies import DeepSpeedStrategy
from lightning.fabric.wrappers import _FabricModule

from flair_fabric.strategies.base import Prepared, SetUp, TrainingStrategy


def deepspeed_is_installed() -> bool:
    """Whether the optional ``deepspeed`` package can be imported."""
    from lightning.fabric.strategies.deepspeed import _DEEPSPEED_AVAILABLE

    return bool(_DEEPSPEED_AVAILABLE)


def require_deepspeed(accelerator: str) -> None:
    """DeepSpeed needs its package and a CUDA GPU."""
    if not deepspeed_is_installed():
        raise ValueError(
            "strategy='deepspeed' needs the deepspeed package, which is not installed: pip install"
            " 'flair-fabric[deepspeed]' (on a machine with CUDA), or use strategy='fsdp'."
        )
    if accelerator != "cuda":
        raise ValueError(
            f"strategy='deepspeed' needs a CUDA GPU, and the accelerator here is {accelerator!r}: use strategy='fsdp',"
            " which shards parameters, gradients and optimizer state on CPU as well."
        )


def check_deepspeed(strategy: DeepSpeedStrategy, accelerator: str) -> DeepSpeedStrategy:
    """A DeepSpeed strategy FabricTrainer can run: package, GPU, and ZeRO stage 1 or 2."""
    require_deepspeed(accelerator)
    stage = (strategy.config or {}).get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage} is not supported by FabricTrainer (stage 3 partitions the parameters, so"
            " flair cannot predict or save with them): use stage 2, or strategy='fsdp' to shard the parameters too."
        )
    return strategy


class FlairDeepSpeedStrategy(DeepSpeedStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy` (ZeRO stage 1 or 2, CUDA only), chosen by
    ``strategy="deepspeed"``, ``"deepspeed_stage_1"`` or ``"deepspeed_stage_2"``; any ``DeepSpeedStrategy(...)``
    object of stage 1 or 2 works the same way."""

    NAMES: ClassVar[dict[str, dict[str, Any]]] = {
        "deepspeed": {"stage": 2},
        "deepspeed_stage_1": {"stage": 1},
        "deepspeed_stage_2": {"stage": 2},
    }

    @classmethod
    def from_name(
        cls, name: str, *, interactive: bool, timeout: timedelta, accelerator: str, find_unused: Any
    ) -> FlairDeepSpeedStrategy:
        """The strategy ``strategy=name`` means; the package and the GPU are checked first (Lightning's constructor
        needs the package)."""
        require_deepspeed(accelerator)
        return cls(**cls.NAMES[name], timeout=timeout)


class DeepSpeed(TrainingStrategy):
    """DeepSpeed ZeRO stage 1/2: the parameters stay whole, so flair saves and predicts with them as usual."""

    clips_gradients_in_engine = True
    shards_training_state = True
    reads_checkpoints_on_every_rank = True

    def __init__(self, strategy: DeepSpeedStrategy) -> None:
        self.strategy = strategy

    def check_run(self, *, reduces_vocabulary: bool, mini_batch_chunk_size: int | str | None) -> None:
        super().check_run(reduces_vocabulary=reduces_vocabulary, mini_batch_chunk_size=mini_batch_chunk_size)
        if mini_batch_chunk_size is not None:
            raise ValueError(
                "mini_batch_chunk_size cannot be used with strategy='deepspeed' (its engine steps on every backward):"
                " set DeepSpeed's gradient accumulation instead, or use strategy='fsdp'."
            )

    def set_up(self, run: SetUp) -> Prepared:
        fabric, model, make_optimizer = run.fabric, run.model, run.make_optimizer
        assert self.strategy.config is not None
        self.strategy.config["gradient_clipping"] = run.max_grad_norm or 0.0
        module, optimizer = fabric.setup(model, make_optimizer(model))
        module.mark_forward_method("forward_loss")
        return Prepared(module, optimizer, model)

    def checkpoint_keys(self, model: flair.nn.Model) -> set[str] | None:
        return None  # DeepSpeed's own checkpoint folder keeps every weight (it filters nothing)

    def load_checkpoint(self, fabric: Fabric, path: Path, module: _FabricModule, optimizer: Any) -> None:
        fabric.load(path, {"model": module, "optimizer": optimizer}, weights_only=True)  # DeepSpeed's own folder
