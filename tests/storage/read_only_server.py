"""A bucket that may be read but not written: a second S3 server on loopback (moto, in a process of its own) that
checks IAM policies once its set-up requests are done (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``), with a user whose
policy allows reading only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

READ_ONLY_BUCKET = "read-only-bucket"
READER_POLICY = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": ["s3:PutObject", "s3:DeleteObject", "s3:CreateBucket"], "Resource": "*"},
    ],
}
_SERVER = r"""
import json, logging, os, socket, sys
objects = json.loads(sys.argv[1])
os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(4 + len(objects))  # the set-up below; then every request is checked
import boto3
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
server.start()
endpoint = f"http://127.0.0.1:{port}"
options = {"endpoint_url": endpoint, "aws_access_key_id": "set-up", "aws_secret_access_key": "set-up"}
s3 = boto3.client("s3", region_name="us-east-1", **options)
iam = boto3.client("iam", region_name="us-east-1", **options)
s3.create_bucket(Bucket=sys.argv[2])
for key, text in objects.items():
    s3.put_object(Bucket=sys.argv[2], Key=key, Body=text.encode())
iam.create_user(UserName="reader")
iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=sys.argv[3])
access = iam.create_access_key(UserName="reader")["AccessKey"]
print(json.dumps({"endpoint": endpoint, "key": access["AccessKeyId"], "secret": access["SecretAccessKey"]}), flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def read_only_bucket(objects: dict[str, str]) -> Iterator[dict[str, Any]]:
    """A running server whose bucket holds ``objects`` (key -> text); yields the ``storage_options`` of its reader."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    arguments = [json.dumps(objects), READ_ONLY_BUCKET, json.dumps(READER_POLICY)]
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, *arguments], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        started = json.loads(server.stdout.readline())
        yield {
            "key": started["key"],
            "secret": started["secret"],
            "client_kwargs": {"endpoint_url": started["endpoint"]},
        }
        server.stdin.close()
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
