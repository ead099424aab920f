"""The first step on a fresh machine whose corpus lies in an S3 bucket, against the same run with the corpus already in
the node-local cache (issue 51's goal: within 1.2x of that run plus the download at the measured bandwidth):

    python benchmarks/corpus_from_store.py [--size 200000] [--steps 5] [--repeats 3] [--out benchmarks/results]

An S3 server on loopback (moto, in a process of its own) holds train/dev/test column files written as
``mapped_corpus.py`` writes them (``size`` WNUT-16 tweets drawn with replacement, dev and test 200 each). Then:

- ``build_s``: a fresh process opens ``MappedCorpus.from_column_files("s3://bucket/tweets", ...)`` with an empty
  cache folder: it streams the sources from the bucket, builds the entry and publishes it beside them;
- ``bandwidth_mb_s``: the published entry's files downloaded by s3fs (``fs.get``) into a local folder, the median
  of ``--repeats``; ``download_s``: the entry's size at that bandwidth;
- ``fresh_first_step_s``: ``mapped_corpus.py``'s run (one process, the RNN tagger, batches of 32; from just before
  the corpus is opened to the end of the first optimizer step) on a fresh machine: an empty node-local cache, so the
  open downloads the published entry, checks it (SHA-256) and maps it; ``cached_first_step_s``: the same run again
  with that cache folder (the entry there, verified); each the median of ``--repeats`` (fresh and cached
  alternate, each fresh run with a new cache folder);
- ``ratio``: ``fresh_first_step_s / (cached_first_step_s + download_s)`` (the goal: at most 1.2).
Both runs ask the store for the sources' listing and sizes (the key); neither reads a source. Writes
``corpus_from_store.json`` and ``corpus_from_store.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bucket"
SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server() -> subprocess.Popen:
    """moto's S3 server on a free port of 127.0.0.1, in a process of its own; its variables set in ``os.environ``."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    return server


def _first_step(config: dict[str, Any], root: Path, name: str, timeout: float) -> dict[str, Any]:
    """``mapped_corpus.py``'s run of one process on ``config``; its rank's measurements."""
    from mapped_corpus import _child

    out = root / "runs" / name
    out.mkdir(parents=True)
    path = root / f"{name}.json"
    path.write_text(json.dumps({**config, "out": str(out), "base": str(out / "base")}))
    _child(["--rank", str(path)], timeout)
    return dict(json.loads((out / "rank0.json").read_text()))


def _bandwidth(entry: str, target: Path) -> tuple[float, int]:
    """The published entry's files downloaded into ``target`` by s3fs: MB/s and the bytes."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    names = [name for name in fs.ls(entry, refresh=True)]
    target.mkdir(parents=True)
    started = time.perf_counter()
    fs.get(names, [str(target / Path(name).name) for name in names])
    seconds = time.perf_counter() - started
    size = sum(path.stat().st_size for path in target.iterdir())
    return size / 1e6 / seconds, size


def measure(options: argparse.Namespace) -> dict[str, Any]:
    import fsspec
    from mapped_corpus import OPTIONS, _child, write_corpus

    server = start_server()
    try:
        with tempfile.TemporaryDirectory(prefix="corpus-from-store-") as temporary:
            root = Path(temporary)
            types = write_corpus(root / "data", options.size)
            fs = fsspec.filesystem("s3", skip_instance_cache=True)
            fs.mkdir(BUCKET)
            for path in sorted((root / "data").iterdir()):
                fs.put_file(str(path), f"{BUCKET}/tweets/{path.name}")
            url = f"s3://{BUCKET}/tweets"
            source_mib = sum(path.stat().st_size for path in (root / "data").iterdir()) / 2**20
            build_config = {"folder": url, "cache": str(root / "builder")}
            (root / "build.json").write_text(json.dumps(build_config))
            build = json.loads(_child(["--build", str(root / "build.json")], options.timeout).strip().splitlines()[-1])
            print(f"built and published in {build['build_s']:.1f} s ({build['cache_mib']:.0f} MiB)", flush=True)
            published = fs.find(f"{BUCKET}/tweets/.flair_fabric_cache")
            entry = str(Path(published[0]).parent)
            speeds = []
            for repeat in range(options.repeats):
                speed, size = _bandwidth(entry, root / f"bandwidth-{repeat}")
                speeds.append(speed)
            bandwidth = statistics.median(speeds)
            print(f"download bandwidth {bandwidth:.0f} MB/s ({size / 2**20:.0f} MiB)", flush=True)
            run = {"kind": "mapped", "folder": url, "model": "rnn", "types": types, "ranks": 1, "steps": options.steps}
            runs: dict[str, list[dict[str, Any]]] = {"fresh": [], "cached": []}
            for repeat in range(options.repeats):
                config = {**run, "cache": str(root / f"node-{repeat}")}
                runs["fresh"].append(_first_step(config, root, f"fresh-{repeat}", options.timeout))
                runs["cached"].append(_first_step(config, root, f"cached-{repeat}", options.timeout))
                print(
                    f"repeat {repeat}: fresh {runs['fresh'][-1]['first_step_s']:.2f} s, "
                    f"cached {runs['cached'][-1]['first_step_s']:.2f} s",
                    flush=True,
                )
            assert OPTIONS["sample_missing_splits"] is False
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)

    def median(kind: str, key: str) -> float:
        return statistics.median(each[key] for each in runs[kind])

    download_s = size / 1e6 / bandwidth
    result = {
        "sentences": options.size,
        "source_mib": source_mib,
        "entry_mib": size / 2**20,
        "build_s": build["build_s"],
        "bandwidth_mb_s": bandwidth,
        "bandwidths_mb_s": speeds,
        "download_s": download_s,
        "fresh_first_step_s": median("fresh", "first_step_s"),
        "cached_first_step_s": median("cached", "first_step_s"),
        "fresh_read_s": median("fresh", "read_s"),
        "cached_read_s": median("cached", "read_s"),
        "runs": runs,
    }
    result["ratio"] = result["fresh_first_step_s"] / (result["cached_first_step_s"] + download_s)
    return result


def markdown(result: dict[str, Any]) -> str:
    setup, row = result["setup"], result["result"]
    return "\n".join(
        [
            f"# First step with the corpus in an S3 bucket ({setup['cpus']} CPUs, median of {setup['repeats']})",
            "",
            "| sentences | entry MiB | build + publish s | download MB/s (s) | first step, fresh machine s (open s) |"
            " first step, entry cached s (open s) | fresh / (cached + download) |",
            "|---|---|---|---|---|---|---|",
            f"| {row['sentences']:,} | {row['entry_mib']:.0f} | {row['build_s']:.1f} |"
            f" {row['bandwidth_mb_s']:.0f} ({row['download_s']:.2f}) |"
            f" {row['fresh_first_step_s']:.2f} ({row['fresh_read_s']:.2f}) |"
            f" {row['cached_first_step_s']:.2f} ({row['cached_read_s']:.2f}) | {row['ratio']:.2f} |",
            "",
            "moto's S3 server on loopback (another process), reached through s3fs; one training process, the RNN",
            "tagger of `mapped_corpus.py`. The fresh machine's open downloads the published entry, hashes it against",
            "its record and maps it. The goal (issue 51): the ratio at most 1.2.",
            f"Load average {setup['load_average_start']} at start, {setup['load_average_end']} at end.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", type=int, default=200_000, help="training sentences")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (K)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind (the median is kept)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    setup = {"cpus": os.cpu_count(), "repeats": options.repeats, "steps": options.steps}
    setup["load_average_start"] = [round(value, 2) for value in os.getloadavg()]
    result = {"setup": setup, "result": measure(options)}
    setup["load_average_end"] = [round(value, 2) for value in os.getloadavg()]
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "corpus_from_store.json").write_text(json.dumps(result, indent=2) + "\n")
    (options.out / "corpus_from_store.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
