"""PowerSGD together with DDP's search for unused parameters is refused when the strategy is about to wrap the model
(docs/limits.md), before DDP or the compression hook exist: without the refusal the two ranks' PowerSGD collectives
fall out of step and the workers abort, which a test cannot tell from any other crash. So the wrapping itself is
stood in for here, and the refusal must come first; tests/strategies/test_compression.py checks its message on two
forked ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy

import flair_fabric.strategies.ddp as ddp_module
from flair_fabric import FlairDDPStrategy


@pytest.mark.parametrize(("compression", "refused"), [("powersgd", True), ("bf16", False), ("fp16", False)])
def test_powersgd_is_refused_before_a_model_that_searches_for_unused_parameters_is_wrapped(
    monkeypatch: pytest.MonkeyPatch, compression: str, refused: bool
) -> None:
    wrapped: list[Any] = []
    monkeypatch.setattr(DDPStrategy, "setup_module", lambda self, module: wrapped.append(module) or module)
    monkeypatch.setattr(ddp_module, "register_compression", lambda module, *args: None)
    strategy = FlairDDPStrategy(find_unused_parameters=True, gradient_compression=compression)
    model = torch.nn.Linear(2, 2)
    if refused:
        with pytest.raises(ValueError, match=r"gradient_compression='powersgd' with find_unused_parameters=True"):
            strategy.setup_module(model)
        assert wrapped == [], "refused before DDP wraps the model"
    else:
        strategy.setup_module(model)
        assert wrapped == [model]
