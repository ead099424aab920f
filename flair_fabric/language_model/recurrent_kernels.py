"""bfloat16 precision for flair's LSTM language model on CPUs without bfloat16 instructions.

Under ``bf16-mixed`` (or ``bf16-true``) on a CPU, PyTorch runs the LSTM through oneDNN in bfloat16. oneDNN builds
that kernel only on CPUs with bfloat16 instructions (AVX512-BF16, AMX); elsewhere the first step stops with "could
not create a primitive descriptor for the LSTM forward propagation primitive". There the LSTM's forward and backward
run with oneDNN switched off: PyTorch's own LSTM, in float32 under ``bf16-mixed`` (autocast leaves it so), while the
embedding and the decoder keep bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from lightning.fabric import Fabric

log = logging.getLogger("flair")


def cpu_has_bfloat16_lstm() -> bool:
    """Whether oneDNN can run a bfloat16 LSTM on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def recurrent_kernels(fabric: Fabric) -> AbstractContextManager[None]:
    """The context for the language model's forward and backward pass: oneDNN off where its bfloat16 LSTM cannot run
    (a CPU device, a bfloat16 precision, a CPU without bfloat16 instructions), otherwise nothing."""
    precision = str(getattr(fabric.strategy.precision, "precision", ""))
    if fabric.device.type != "cpu" or not precision.startswith("bf16") or cpu_has_bfloat16_lstm():
        return nullcontext()
    return without_onednn()


@contextmanager
def without_onednn() -> Iterator[None]:
    enabled = bool(torch.backends.mkldnn.enabled)
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a settable property of the module
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled  # type: ignore[assignment]


def explain_recurrent_kernels(fabric: Fabric) -> None:
    """Log once, on global rank 0, when the LSTM runs without oneDNN."""
    if fabric.is_global_zero and not isinstance(recurrent_kernels(fabric), nullcontext):
        log.warning(
            "this CPU has no bfloat16 instructions for oneDNN's LSTM: under %s the LSTM runs in PyTorch's own kernel"
            " (in float32 under bf16-mixed); the embedding and the decoder keep bfloat16.",
            fabric.strategy.precision.precision,
        )
