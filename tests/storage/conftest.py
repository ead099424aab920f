"""The S3 server of the storage tests: one per session; each test that asks for ``s3`` gets its variables set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..storage_server import S3Server, start_server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1, stopped at the end of the session."""
    running = start_server()
    yield running
    running.server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """The server's endpoint and fake credentials in the environment (no credentials file of this machine is read),
    and no s3fs filesystem cached from another test's environment."""
    import s3fs

    nowhere = tmp_path_factory.mktemp("no-aws") / "none"
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nowhere))
    s3fs.S3FileSystem.clear_instance_cache()
    return s3_server
