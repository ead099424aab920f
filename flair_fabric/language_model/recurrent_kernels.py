"""``bf16-mixed`` for flair's LSTM language model on CPUs without bfloat16 instructions.

Under ``bf16-mixed`` on a CPU, PyTorch runs the LSTM through oneDNN in bfloat16. oneDNN builds that kernel only on
CPUs with bfloat16 instructions (AVX512-BF16, AMX); elsewhere the first step stops with "could not create a
primitive descriptor for the LSTM forward propagation primitive". There the run goes with oneDNN switched off:
PyTorch's own LSTM, in float32 (autocast leaves it so), while the embedding and the decoder keep bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.fabric import Fabric

log = logging.getLogger("flair")


def lstm_needs_no_onednn(fabric: Fabric) -> bool:
    """A CPU device, a bfloat16 precision, and a CPU on which oneDNN has no bfloat16 LSTM."""
    precision = str(getattr(fabric.strategy.precision, "precision", ""))
    if fabric.device.type != "cpu" or not precision.startswith("bf16"):
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


@contextmanager
def recurrent_kernels(fabric: Fabric) -> Iterator[None]:
    """The context of a rank's whole run: oneDNN off where its bfloat16 LSTM cannot run (said once, on global rank
    0), restored afterwards; otherwise nothing changes."""
    if not lstm_needs_no_onednn(fabric):
        yield
        return
    if fabric.is_global_zero:
        log.warning(
            "this CPU has no bfloat16 instructions for oneDNN's LSTM: the LSTM runs in PyTorch's own kernel in float32;"
            " the embedding and the decoder keep bfloat16."
        )
    enabled = bool(torch.backends.mkldnn.enabled)
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a settable property of the module
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled  # type: ignore[assignment]
