"""``engine: ray``: the ``train`` command ships the same config to a Ray cluster, where each of Ray Train's workers
runs the command as it would run here (a facade: the workers run the same job, and find Ray's world themselves).

The keys, in the config's style (``--engine ray --ray.address auto --ray.num_workers 4 --ray.use_gpu true``)::

    engine: ray            # local (the default): train here; ray: submit to a Ray cluster
    ray:
      address: auto        # ray.init(address=...): 'auto' an existing cluster, null a local one started here
      num_workers: 4       # ScalingConfig(num_workers=...)
      use_gpu: true        # ScalingConfig(use_gpu=...)
      storage_path: null   # RunConfig(storage_path=...): where Ray keeps the reported checkpoints
      name: null           # RunConfig(name=...)
      max_failures: 0      # FailureConfig(max_failures=...): restarts after a lost worker
      num_to_keep: null    # CheckpointConfig(num_to_keep=...)

Nothing of Ray is imported before the config is checked; without the ``[ray]`` extra, ``engine: ray`` is refused
right after the first pass, naming the extra.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RayOptions:
    """Where and how a Ray submission runs (the config's ``ray`` section)."""

    address: str | None = None
    num_workers: int = 1
    use_gpu: bool = False
    storage_path: str | None = None
    name: str | None = None
    max_failures: int = 0
    num_to_keep: int | None = None


def submit(argv: list[str], options: RayOptions | dict, command: Callable[[list[str]], Any]) -> Any:
    """Run ``command(argv)`` (the ``train`` command) in ``num_workers`` Ray Train workers; returns global rank 0's
    result."""
    from flair_fabric.launch.ray_train import require_ray_train

    require_ray_train("engine: ray")
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray_options = options if isinstance(options, RayOptions) else RayOptions(**dict(options))
    if ray_options.num_workers < 1:
        raise ValueError(f"ray.num_workers={ray_options.num_workers}: pass at least 1 worker.")
    if not ray.is_initialized():
        ray.init(address=ray_options.address)
    trainer = TorchTrainer(
        functools.partial(_run_in_worker, command=command),
        train_loop_config={"argv": list(argv), "cwd": os.getcwd()},
        scaling_config=ScalingConfig(num_workers=ray_options.num_workers, use_gpu=ray_options.use_gpu),
        run_config=RunConfig(
            name=ray_options.name,
            storage_path=ray_options.storage_path,
            failure_config=FailureConfig(max_failures=ray_options.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=ray_options.num_to_keep),
        ),
    )
    return getattr(trainer.fit(), "return_value", None)  # Ray Train V2: the training function's, global rank 0's


def _run_in_worker(config: dict, command: Callable[[list[str]], Any]) -> Any:
    """A Ray Train worker: the command, from the caller's folder where this machine has it (relative paths)."""
    if Path(config["cwd"]).is_dir():
        os.chdir(config["cwd"])
    return command(config["argv"])
