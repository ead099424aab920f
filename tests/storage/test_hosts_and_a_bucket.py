"""Two hosts in network namespaces (tests/hosts) with nothing shared but an S3 bucket, served by moto on a third
host: the host of global rank 0 falls off the network mid-epoch, and the other host resumes the run alone from the
bucket, to the weights of one process on the union of the batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ..hosts.network import Host, hosts_on_a_network
from ..hosts.test_hosts import ENV, UNION, _finish, _start, _union_weights
from ..storage_server import KEY_ID, REGION, SECRET
from ..support import SCRIPTS, RunHung, expect_success, state_dict_difference

pytestmark = pytest.mark.multiprocess

S3_PORT = 29650
MAKE_BUCKET = """
import sys, time, boto3, botocore
client = boto3.client("s3", endpoint_url=sys.argv[1])
for _ in range(150):
    try:
        client.create_bucket(Bucket="bucket")
        break
    except botocore.exceptions.EndpointConnectionError:
        time.sleep(0.2)
else:
    raise SystemExit("the S3 server did not answer")
"""


def _environment(endpoint: str, host: Host) -> dict[str, str]:
    """A host's environment: the store's endpoint and fake credentials, its own staging folder."""
    return {
        **ENV,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_SHARED_CREDENTIALS_FILE": str(host.folder / "none"),
        "AWS_CONFIG_FILE": str(host.folder / "none"),
        "FLAIR_FABRIC_STAGING": str(host.folder / "staging"),
    }


def test_the_host_of_global_rank_0_is_lost_and_the_other_resumes_from_the_bucket(tmp_path: Path) -> None:
    """torchrun on hosts 0 and 1 (2 nodes), base_path in the bucket on host 2, a checkpoint every 3 steps; host 0's
    link goes down after step 10 (of 12, mid-epoch 2). Host 1's job ends within the collective timeout; host 1 never
    held a checkpoint file; alone, with resume_from="auto", it continues from the bucket's newest complete checkpoint
    to the weights of one process on the union of the batches."""
    timeout = 8
    with hosts_on_a_network(tmp_path, 3) as hosts:
        store = hosts[2]
        endpoint = f"http://{store.address}:{S3_PORT}"
        store.start([sys.executable, "-m", "moto.server", "-H", store.address, "-p", str(S3_PORT)], ENV)
        made = hosts[1].start([sys.executable, "-c", MAKE_BUCKET, endpoint], _environment(endpoint, hosts[1]))
        expect_success(made.wait(timeout=60), "making the bucket", made.communicate()[0])
        url = "s3://bucket/two-hosts"
        kwargs: dict[str, Any] = {**UNION, "max_epochs": 2, "devices": 1, "num_nodes": 2, "strategy": "ddp"}
        kwargs |= {"collective_timeout": timeout, "checkpoint_every_n_steps": 3}
        master = hosts[0].address
        started = []
        for node, host in enumerate(hosts[:2]):
            environment = _environment(endpoint, host)
            started.append(_start(host, 2, node, master, kwargs, environment, kill_at=10, kill_node=0, base_path=url))
        try:
            code, output = _finish(started[1:], timeout=timeout * 10)[0]
        except Exception as error:
            raise RunHung(f"host 1's job did not end after host 0 was lost: {error}") from None
        assert code != 0, "host 1's job ended with its peer gone"
        assert (hosts[0].folder / "results" / "link-down.txt").exists(), output[-3000:]
        hosts[0].end_everything()
        assert not list((hosts[1].folder / "staging").glob("*/checkpoints/step-*")), "host 1 held no checkpoint"

        alone = {**UNION, "mini_batch_size": 8, "max_epochs": 2, "devices": 1, "resume_from": "auto"}
        config = hosts[1].folder / "alone.json"
        config.write_text(json.dumps({"out": str(hosts[1].folder), "kwargs": alone, "base_path": url}))
        command = [sys.executable, str(SCRIPTS / "host_training.py"), str(config)]
        finished = _finish([hosts[1].start(command, _environment(endpoint, hosts[1]))])
        expect_success(finished[0][0], "host 1 alone", finished[0][1])
        output = finished[0][1]
        assert f"resuming from {url}/checkpoints/step-00000000" in output, output[-3000:]
        assert "resuming a checkpoint of 2 process(es) on 1" in output
        resumed = torch.load(hosts[1].folder / "results" / "weights-rank0.pt")
        assert state_dict_difference(resumed, _union_weights(2, tmp_path)) < 1e-5, output[-6000:]
