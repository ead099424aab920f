"""Lightning's arguments resolved by Lightning, plus the few checks Fabric does not make, all before any process
starts; each error names the argument and the fix.

Precision strings and their aliases (``"bf16"``, ``"16"``, ``32``, ...) are resolved by Fabric's own connector.
flair-fabric adds what is particular to it: ``devices`` counts processes on CPU, strategy names map to its own
strategies (:class:`~flair_fabric.FlairDDPStrategy` with the script relaunch, spawn or fork, :class:`~flair_fabric.
FlairFSDPStrategy`, DeepSpeed), each strategy's own checks (:func:`~flair_fabric.strategies.check_strategy`), and the
checks of the environment: ``devices``/``num_nodes`` against what torchrun or SLURM started (a mismatch would hang),
no relaunch or spawn from a notebook, no fork after CUDA was initialised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import Strategy

from flair_fabric.distributed.stalls import DEFAULT_COLLECTIVE_TIMEOUT, check_collective_timeout
from flair_fabric.launch.environment import (
    ExternalLaunch,
    cluster_environment,
    cuda_driver_initialized,
    cuda_is_initialized,
    external_launch,
    foreign_process_group_size,
    is_interactive,
    quiet_lightning_banner,
    use_this_ranks_gpu,
)
from flair_fabric.strategies import (
    brings_cluster_environment,
    check_strategy,
    is_strategy_object,
    resolve_strategy,
    start_method,
    starts_workers,
    strategy_name,
    timeout_of,
)

log = logging.getLogger("flair")
quiet_lightning_banner()  # every process of a run imports this module before Lightning initialises the group
use_this_ranks_gpu()  # before the user's script builds its model on flair's default device

DevicesArgument = int | str | Sequence[int]
StrategyArgument = str | Strategy

AUTO = "auto"
ACCELERATORS = (AUTO, "cpu", "cuda", "gpu", "mps")
_GPU_ONLY_PRECISIONS = ("16-mixed", "16-true")


@dataclass(frozen=True)
class LaunchConfig:
    """The checked, resolved form of Lightning's five arguments."""

    accelerator: str
    devices: int | list[int]
    num_nodes: int
    strategy: StrategyArgument
    precision: str
    collective_timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT

    @property
    def world_size(self) -> int:
        """Number of processes the run will use across all nodes."""
        count = self.devices if isinstance(self.devices, int) else len(self.devices)
        return count * self.num_nodes


def resolve_accelerator(accelerator: str) -> str:
    """Return the concrete accelerator (``cpu``, ``cuda`` or ``mps``) that ``accelerator`` means on this machine."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not supported; choose one of {', '.join(ACCELERATORS)}.")
    if accelerator == "auto":
        if CUDAAccelerator.is_available():
            return "cuda"
        return "mps" if MPSAccelerator.is_available() else "cpu"
    if accelerator == "gpu":
        return "cuda" if CUDAAccelerator.is_available() or not MPSAccelerator.is_available() else "mps"
    return accelerator


def available_device_count(accelerator: str) -> int | None:
    """Devices of this kind on the machine; ``None`` for CPU, where ``devices`` counts processes, not chips."""
    if accelerator == "cuda":
        return CUDAAccelerator.auto_device_count() if CUDAAccelerator.is_available() else 0
    if accelerator == "mps":
        return 1 if MPSAccelerator.is_available() else 0
    return None


def resolve_devices(devices: DevicesArgument, accelerator: str) -> int | list[int]:
    """Check ``devices`` and turn it into a count or a list of device indices."""
    available = available_device_count(accelerator)
    if devices == "auto":
        launched = external_launch()
        if launched is not None:
            return launched.devices
        return 1 if available is None else max(available, 1)
    if isinstance(devices, str):
        devices = _parse_devices_string(devices)
    if isinstance(devices, bool):
        raise ValueError(f"devices={devices!r} is not valid: pass a positive int, -1, 'auto' or a list of indices.")
    if available is None and (devices == -1 or not isinstance(devices, int)):
        raise ValueError(
            f"devices={devices!r} selects GPUs; on CPU devices is the number of processes: pass e.g. devices=2."
        )
    if isinstance(devices, int):
        if devices == -1:
            return max(available or 0, 1)
        if devices < 1:
            raise ValueError(
                f"devices={devices} is not valid: pass a positive number of devices, -1 for all, or 'auto'."
            )
        count = devices
    else:
        indices = list(devices)
        if not indices or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
            raise ValueError(f"devices={devices!r} is not valid: a list of devices must hold non-negative indices.")
        if len(set(indices)) != len(indices):
            raise ValueError(f"devices={devices!r} names a device twice: list each index once.")
        if available is not None and max(indices) >= available:
            raise ValueError(
                f"devices={indices} asks for {accelerator} device {max(indices)}, but this machine has {available}"
                f" {accelerator} device(s): use indices below {available}."
            )
        count = len(indices)
    if available is not None and count > available:
        raise ValueError(
            f"devices={count} asks for more {accelerator} devices than this machine has ({available}):"
            f" pass devices={available} or fewer, or accelerator='cpu'."
        )
    if available is None and count > (os.cpu_count() or 1):
        log.warning(f"devices={count} starts more CPU processes than this machine has cores ({os.cpu_count()}).")
    return devices if isinstance(devices, int) else list(devices)


def _parse_devices_string(devices: str) -> int | list[int]:
    text = devices.strip()
    try:
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text)
    except ValueError:
        raise ValueError(
            f"devices={devices!r} is not valid: pass a positive int, -1, 'auto' or a list of indices such as [0, 1]."
        ) from None


def resolve_precision(precision: str | int | None, use_amp: bool, accelerator: str) -> str:
    """Map flair's ``use_amp`` and Lightning's ``precision`` (any spelling Fabric accepts) to Fabric's name for it."""
    if use_amp and precision is not None:
        raise ValueError(
            f"use_amp=True and precision={precision!r} were both given: pass only precision= (use_amp is flair's"
            " older switch for mixed precision)."
        )
    if use_amp:
        precision = "16-mixed" if accelerator == "cuda" else "bf16-mixed"
        log.info(f"use_amp=True: training with Fabric precision '{precision}' on {accelerator}.")
    if precision is None:
        return "32-true"
    if str(precision).startswith("transformer-engine"):
        raise ValueError(
            f"precision={precision!r} is not supported by flair-fabric: Transformer Engine replaces the model's layers,"
            " which flair's models were never trained or saved with; use precision='bf16-mixed' (or '16-mixed')."
        )
    try:  # Fabric's connector resolves the aliases and refuses what the accelerator cannot do
        with warnings.catch_warnings(), _lightning_quiet():
            warnings.simplefilter("ignore")  # Lightning's note that an alias was translated
            fabric = Fabric(
                accelerator=accelerator,
                devices=1,
                precision=precision,  # type: ignore[arg-type]
                plugins=[LightningEnvironment()],  # one local process; no cluster detection (see cluster_environment)
            )
    except (ValueError, TypeError, RuntimeError) as error:
        raise ValueError(f"precision={precision!r} is not supported here: {error}") from None
    resolved = str(getattr(fabric.strategy.precision, "precision", "32-true"))
    fp16_replaced = resolved == "bf16-mixed" and "bf16" not in str(precision)  # Lightning's silent fallback on CPU
    if fp16_replaced or (resolved in _GPU_ONLY_PRECISIONS and accelerator != "cuda"):
        raise ValueError(
            f"precision={precision!r} needs a CUDA GPU; on {accelerator} use precision='bf16-mixed' instead."
        )
    return resolved


@contextlib.contextmanager
def _lightning_quiet() -> Iterator[None]:
    """Lightning's own info lines ("Using bfloat16 Automatic Mixed Precision") off while only resolving."""
    logger = logging.getLogger("lightning.fabric")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_start_method(strategy: StrategyArgument, launched: ExternalLaunch | None, accelerator: str) -> None:
    """Refuse process start-ups that cannot work here: a relaunch from a notebook, workers started by a script that
    torchrun/SLURM already started, and forking after CUDA was initialised."""
    method = start_method(strategy)
    if method is None:
        return
    if launched is not None and starts_workers(strategy):
        raise ValueError(
            f"{launched.description}: the processes exist already, so strategy=... must not start more;"
            " use strategy='ddp' or 'auto'."
        )
    if method == "popen" and launched is None and is_interactive():
        raise ValueError(
            "strategy='ddp' relaunches the running script once per device, which a notebook or REPL cannot do:"
            " use strategy='ddp_notebook' (or 'auto') here, or run a script."
        )
    if method == "spawn" and launched is None and is_interactive():
        raise ValueError(
            "strategy='ddp_spawn' starts fresh Python processes that import the running program, which a notebook or"
            " REPL does not have as a file: use strategy='ddp_notebook' (or 'auto', which forks) here, or run a"
            " script."
        )
    if method == "fork" and cuda_is_initialized():
        raise RuntimeError(
            "strategy='ddp_fork'/'ddp_notebook' cannot fork worker processes: CUDA is already initialised in this"
            " process (flair moves new models to flair.device, cuda:0 by default). Set flair.device ="
            " torch.device('cpu') (or FLAIR_DEVICE=cpu) before building the model and restart the kernel, or use"
            " strategy='ddp_spawn' in a script."
        )
    if method == "fork" and accelerator == "cuda" and cuda_driver_initialized():
        raise RuntimeError(
            "strategy='ddp_fork'/'ddp_notebook' cannot fork worker processes that use the GPU: this process has"
            " initialised the CUDA driver (importing flair before flair_fabric does: flair asks"
            " torch.cuda.is_available() when it is imported). Restart the kernel and import flair_fabric before flair"
            " (or set PYTORCH_NVML_BASED_CUDA_CHECK=1 before importing torch), or use strategy='ddp_spawn' in a script."
        )


def check_external_launch(devices: int | list[int], num_nodes: int | str, launched: ExternalLaunch | None) -> None:
    """``devices`` and ``num_nodes`` must match what torchrun or SLURM started, or every process would hang."""
    if launched is None:
        return
    count = devices if isinstance(devices, int) else len(devices)
    if count != launched.devices:
        raise ValueError(
            f"devices={devices!r}, but {launched.description}: pass devices={launched.devices} or devices='auto'."
        )
    if num_nodes != AUTO and num_nodes != launched.num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes}, but {launched.description}: pass num_nodes='auto' (it follows the launcher, also"
            f" when an elastic agent restarts the job on another number of nodes) or num_nodes={launched.num_nodes}."
        )


def check_no_foreign_process_group(world_size: int, launched: ExternalLaunch | None) -> None:
    """Refuse a run inside a process group that another engine made: the run would be a world of its own, and N
    copies would each train alone into the same ``base_path``, in silence. Under Ray Train, torchrun or SLURM a group
    of the run's size is the run's own (Ray makes it before the training function runs; a script may make it
    first)."""
    existing = foreign_process_group_size()
    if existing is None or (existing == world_size and (launched is not None or world_size == 1)):
        return
    raise ValueError(
        f"this process is one of {existing} in a process group that exists already (made by Ray Train, another engine,"
        f" or the script), but this run would be {world_size} process(es) of its own, started"
        f" {'by ' + launched.launcher if launched else 'here'}: each of the {existing} would train alone. flair-fabric"
        " runs inside Ray Train's process group (a TorchTrainer's training function), not another engine's: start the"
        " job with Ray Train, torchrun or SLURM (devices and num_nodes 'auto'), or with devices=N from one process, or"
        " destroy the group first (torch.distributed.destroy_process_group())."
    )


def check_num_nodes(num_nodes: Any) -> int | str:
    """Check ``num_nodes``: a positive int, or ``"auto"``."""
    if num_nodes == AUTO:
        return AUTO
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(
            f"num_nodes={num_nodes!r} is not valid: pass the number of machines, a positive int, or 'auto' (what"
            " torchrun or SLURM started, else 1)."
        )
    return num_nodes


def resolve_num_nodes(num_nodes: int | str, launched: ExternalLaunch | None) -> int:
    """The number of machines: ``num_nodes`` as given; for ``"auto"`` the launcher's (Ray's, torchrun's, SLURM's),
    else 1."""
    if num_nodes != AUTO:
        return int(num_nodes)
    return launched.num_nodes if launched is not None else 1


def make_launch_config(
    *,
    accelerator: str,
    devices: DevicesArgument,
    num_nodes: int | str,
    strategy: StrategyArgument,
    precision: str | int | None,
    use_amp: bool = False,
    collective_timeout: float | timedelta | None = None,
) -> LaunchConfig:
    """Check and resolve Lightning's five arguments (plus flair's ``use_amp`` and ``collective_timeout``) without
    starting anything."""
    timeout = check_collective_timeout(collective_timeout)
    if collective_timeout is not None and is_strategy_object(strategy):
        raise ValueError(
            f"collective_timeout={collective_timeout!r} and a strategy object were both given: pass timeout= to the"
            f" {strategy_name(strategy)}(...) instead."
        )
    timeout = timeout_of(strategy) or timeout
    concrete_accelerator = resolve_accelerator(accelerator)
    resolved_devices = resolve_devices(devices, concrete_accelerator)
    given_nodes = check_num_nodes(num_nodes)
    resolved_precision = resolve_precision(precision, use_amp, concrete_accelerator)
    launched = external_launch()
    check_external_launch(resolved_devices, given_nodes, launched)
    nodes = resolve_num_nodes(given_nodes, launched)
    count = resolved_devices if isinstance(resolved_devices, int) else len(resolved_devices)
    resolved_strategy = resolve_strategy(
        strategy,
        world_size=count * nodes,
        accelerator=concrete_accelerator,
        launched=launched is not None,
        interactive=launched is None and is_interactive(),
        timeout=timeout,
    )
    check_no_foreign_process_group(count * nodes, launched)
    check_start_method(resolved_strategy, launched, concrete_accelerator)
    check_strategy(resolved_strategy, concrete_accelerator, resolved_precision)
    return LaunchConfig(concrete_accelerator, resolved_devices, nodes, resolved_strategy, resolved_precision, timeout)


def build_fabric(config: LaunchConfig) -> Fabric:
    """Create the Fabric for ``config``; processes start only when :meth:`Fabric.launch` is called.

    The cluster environment is chosen here (:func:`cluster_environment`), not by Fabric, unless a strategy object
    brings its own: Fabric's detection initialises MPI in every process where ``mpi4py`` is installed."""
    own = brings_cluster_environment(config.strategy)
    return Fabric(
        accelerator=config.accelerator,
        devices=config.devices,
        num_nodes=config.num_nodes,
        strategy=config.strategy,
        precision=config.precision,  # type: ignore[arg-type]
        plugins=None if own else [cluster_environment()],
    )
