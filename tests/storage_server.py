"""An S3 server on loopback for the storage tests: moto's ``ThreadedMotoServer`` on a free port of 127.0.0.1, one
bucket made in it, reached through s3fs the standard way (``AWS_ENDPOINT_URL`` and the ``AWS_*`` credentials)."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

BUCKET = "bucket"
KEY_ID = "testing-key-id"
SECRET = "fake-secret-Zq8vW3kP"  # fake; the tests grep every message and written file for it
REGION = "us-east-1"


@dataclass
class S3Server:
    """A running server: its endpoint and the variables that reach it."""

    endpoint: str
    server: Any

    def environment(self) -> dict[str, str]:
        """The standard variables s3fs (botocore) reads: endpoint, fake credentials, region."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
        }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server() -> S3Server:
    """Start the server and make the bucket (with explicit credentials: the environment is the tests' to set)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one request log line per call otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    running = S3Server(f"http://127.0.0.1:{port}", server)
    client = boto3.client(
        "s3",
        endpoint_url=running.endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )
    client.create_bucket(Bucket=BUCKET)
    return running
