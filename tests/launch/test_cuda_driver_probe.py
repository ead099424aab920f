"""The probe behind the refusal of ``ddp_fork``/``ddp_notebook`` on a GPU after the CUDA driver was initialised
(docs/gpu-check.md): it asks a driver already loaded into the process (never loading one itself) whether
``cuDeviceGetCount`` answers, which it does only after ``cuInit``. CPU torch has no driver: a stand-in answers."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
import torch

from flair_fabric.launch import environment

CUDA_ERROR_NOT_INITIALIZED = 3


class _Driver:
    """libcuda as ctypes gives it: ``cuDeviceGetCount`` returns a CUresult."""

    def __init__(self, answer: int) -> None:
        self.answer = answer

    def cuDeviceGetCount(self, count: Any) -> int:  # the driver API's name
        return self.answer


@pytest.mark.parametrize(
    ("answer", "initialised"),
    [(0, True), (CUDA_ERROR_NOT_INITIALIZED, False), (None, False)],  # None: no driver loaded into the process
    ids=["driver-initialised", "driver-loaded-not-initialised", "no-driver-loaded"],
)
def test_the_driver_probe_asks_a_loaded_driver_whether_it_was_initialised(
    monkeypatch: pytest.MonkeyPatch, answer: int | None, initialised: bool
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build of torch
    loaded: list[tuple[str, int]] = []

    def load(name: str, mode: int = 0) -> _Driver:
        loaded.append((name, mode))
        if answer is None:
            raise OSError(f"{name}: cannot open shared object file")
        return _Driver(answer)

    monkeypatch.setattr(ctypes, "CDLL", load)
    assert environment.cuda_driver_initialized() is initialised
    assert loaded == [("libcuda.so.1", os.RTLD_NOLOAD)], "the driver already in the process, never a new one"
