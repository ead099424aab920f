"""A corpus in a bucket opened on two hosts in network namespaces (tests/hosts), each with its own cache folder and
nothing shared but the bucket (moto on a third host): the job's second node waits, the first builds and publishes,
the second downloads; both read what flair reads from the same files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from flair.datasets import ColumnCorpus

from ..data.reference import COLUMN_FORMAT, COLUMNS, describe_split, write
from ..hosts.network import Host, hosts_on_a_network
from ..hosts.test_hosts import ENV, _finish
from ..storage_server import KEY_ID, REGION, SECRET
from ..support import expect_success

pytestmark = pytest.mark.multiprocess

S3_PORT = 29651
STORE = """
import sys, time, boto3
from pathlib import Path
from moto.server import ThreadedMotoServer
ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False).start()
client = boto3.client("s3", endpoint_url=f"http://{sys.argv[1]}:{sys.argv[2]}")
client.create_bucket(Bucket="bucket")
for path in sorted(Path(sys.argv[3]).iterdir(), reverse=True):  # train.txt last
    client.upload_file(str(path), "bucket", f"ner/{path.name}")
print("ready", flush=True)
time.sleep(600)
"""
OPEN = """
import json, sys, time
import s3fs
from flair_fabric.data import MappedCorpus
for _ in range(600):  # the store starts while this process imports
    try:
        if s3fs.S3FileSystem(skip_instance_cache=True).exists("bucket/ner/train.txt"):
            break
    except Exception:
        pass
    time.sleep(0.1)
from tests.data.reference import COLUMN_FORMAT, describe_split
options = {"cache_folder": sys.argv[1], "sample_missing_splits": False}
corpus = MappedCorpus.from_column_files("s3://bucket/ner", COLUMN_FORMAT, **options)
found = {"built": corpus.built, "downloaded": corpus.downloaded, "folder": str(corpus.cache_folder)}
print(json.dumps({**found, "train": repr(describe_split(corpus.train))}))
"""


def _environment(endpoint: str, host: Host, node: int) -> dict[str, str]:
    """A host's environment: the store's endpoint, fake credentials, and its node in the job (torchrun's
    ``GROUP_RANK``)."""
    nowhere = str(host.folder / "none")
    values = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    values |= {"AWS_DEFAULT_REGION": REGION, "AWS_SHARED_CREDENTIALS_FILE": nowhere, "AWS_CONFIG_FILE": nowhere}
    environment = {name: value for name, value in ENV.items() if name not in ("NODE_RANK", "SLURM_NODEID")}
    return {**environment, **values, "GROUP_RANK": str(node), "FLAIR_FABRIC_CORPUS_WAIT": "120"}


def test_two_hosts_with_their_own_caches_open_a_corpus_from_the_bucket_built_once(tmp_path: Path) -> None:
    """Host 1 (node 1) opens the corpus first and waits; host 0 (node 0) builds it from the bucket and publishes it;
    host 1 downloads it into its own cache folder: the same bytes, the data points flair reads from the files."""
    with hosts_on_a_network(tmp_path, 3) as hosts:
        store = hosts[2]
        endpoint = f"http://{store.address}:{S3_PORT}"
        sources = hosts[0].folder / "src"
        for name, text in (("train.txt", COLUMNS * 20), ("dev.txt", COLUMNS)):
            write(sources / name, text)
        arguments = [store.address, str(S3_PORT), str(sources)]
        server = store.start([sys.executable, "-c", STORE, *arguments], _environment(endpoint, store, 0))
        opened = [
            host.start([sys.executable, "-c", OPEN, str(host.folder / "cache")], _environment(endpoint, host, node))
            for node, host in reversed(list(enumerate(hosts[:2])))
        ]
        finished = _finish(opened, timeout=180)
        assert server.poll() is None, "the store ended early"
    for code, output in finished:
        expect_success(code, "opening the corpus", output)
        assert SECRET not in output
    second, first = (json.loads(output.strip().splitlines()[-1]) for _, output in finished)
    assert (first["built"], first["downloaded"], second["built"], second["downloaded"]) == (True, False, False, True)
    expected = repr(describe_split(ColumnCorpus(sources, COLUMN_FORMAT, sample_missing_splits=False).train))
    assert first["train"] == expected == second["train"]
    folders = [Path(first["folder"]), Path(second["folder"])]
    assert folders[0].parent == hosts[0].folder / "cache" and folders[1].parent == hosts[1].folder / "cache"
    for name in ("train.arrow", "dev.arrow", "meta.json"):
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
