"""Hand-offs and checkpoints hold plain data in files only their owner can read; the rendezvous port is held from
the moment it is chosen and listens on loopback only."""

from __future__ import annotations

import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from flair_fabric.launch.rendezvous import loopback_rendezvous
from flair_fabric.state.safe_loading import UnsafeFile, as_plain_data, checked_load, save_private


class _CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_a_hand_off_file_is_private_and_loads_as_data_only(tmp_path: Path) -> None:
    save_private({"weights": torch.ones(2), "score": 0.5}, tmp_path / "result.pt")
    assert (tmp_path / "result.pt").stat().st_mode & 0o777 == 0o600
    assert checked_load(tmp_path / "result.pt")["score"] == 0.5
    with tempfile.TemporaryDirectory(prefix="flair-fabric-") as folder:  # where workers hand their result back
        assert Path(folder).stat().st_mode & 0o777 == 0o700
    torch.save({"payload": _CreatesAFile(tmp_path / "code-ran")}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeFile, match=r"evil.pt does not hold plain data"):
        checked_load(tmp_path / "evil.pt")
    assert not (tmp_path / "code-ran").exists()


def test_model_card_values_become_plain_data() -> None:
    card = {"flair_version": torch.__version__, "sampler": object(), "plugins": [{"lr": 0.1}], 3: (1, None)}
    plain = as_plain_data(card)
    assert type(plain["flair_version"]) is str and isinstance(plain["sampler"], str)
    assert plain["plugins"] == [{"lr": 0.1}] and plain[3] == (1, None)


def test_the_rendezvous_port_is_held_from_the_start_and_listens_on_loopback_only() -> None:
    with loopback_rendezvous(timedelta(seconds=10), keep=False) as hosted:
        with socket.socket() as intruder, pytest.raises(OSError):  # no other program can take the port meanwhile
            intruder.bind(("127.0.0.1", hosted.port))
        assert hosted.listener.getsockname()[0] == "127.0.0.1"
        with socket.create_connection(("127.0.0.1", hosted.port), timeout=5):
            pass
