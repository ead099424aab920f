"""How long a lost node costs under torchrun's elastic agent, and how much work: the MiniLM TREC run in a bucket.

Two elastic agents (``--nnodes=1:2``, c10d rendezvous on loopback, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) train
MiniLM (``fine_tune``, global batch 8, a checkpoint every ``--every`` steps) with ``base_path`` in a bucket of moto's
S3 server (its own process). After step ``--kill-at`` one node is SIGKILLed with its worker; the other agent restarts
its worker alone. Measured from the worker's timed events and its log: the failure to the new process's start (the
agent noticing, the rendezvous, the start), the process start to the checkpoint chosen and downloaded (imports,
corpus, model, the bucket), to the set-up's end (Fabric, the process group, the set-up), to the checkpoint loaded, to
the first step; and the steps done again.

    python benchmarks/elastic_restart.py [--every 20] [--kill-at 30]

Results: ``benchmarks/results/elastic_restart.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import free_port, machine  # noqa: E402
from store_checkpoints import BUCKET, start_s3_server  # noqa: E402

from tests.support import kill_with_descendants  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


def _agent(config: Path, port: int, staging: Path, log: Path, hosts_rendezvous: bool) -> subprocess.Popen:
    elastic = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    elastic += ["--rdzv-id=bench", "--local-addr=127.0.0.1", "--max-restarts=3", "--monitor-interval=0.2"]
    elastic += [f"--rdzv-conf=last_call_timeout=1,join_timeout=300,is_host={int(hosts_rendezvous)}"]
    env = {**os.environ, "FLAIR_FABRIC_STAGING": str(staging), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [TORCHRUN, *elastic, str(HERE / "elastic_worker.py"), str(config)]
    with log.open("w") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _logged(log: Path, text: str, after: float) -> float:
    """When the first line holding ``text`` was logged after ``after`` (the log's local-time stamps)."""
    for line in log.read_text(errors="replace").splitlines():
        found = LOGGED.match(line)
        if found and text in found.group(2):
            stamp = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if stamp >= after:
                return stamp
    raise RuntimeError(f"{text!r} not logged after the failure")


def _wait(condition: Any, what: str, within: float = 900) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {within} s")
        time.sleep(0.1)


def measure(work: Path, every: int, kill_at: int, train_size: int) -> dict[str, Any]:
    config = work / "config.json"
    url = f"s3://{BUCKET}/elastic-bench"
    config.write_text(
        json.dumps(
            {"out": str(work), "base_path": url, "every": every, "global_batch_size": 8, "train_size": train_size}
        )
    )
    events = work / "events.jsonl"
    port = free_port()
    agents = [_agent(config, port, work / "staging-a", work / "agent-a.log", True)]
    try:
        time.sleep(1.0)
        agents.append(_agent(config, port, work / "staging-b", work / "agent-b.log", False))
        steps = lambda: [e for e in _events(events) if e["event"] == "step"]  # noqa: E731
        _wait(lambda: any(e["world"] == 2 and e["step"] >= kill_at for e in steps()), "2 nodes reach the step")
        killed_at_step = max(e["step"] for e in steps())
        killed = time.time()
        kill_with_descendants(agents[1].pid)
        alone = lambda: [e for e in steps() if e["world"] == 1 and e["time"] > killed]  # noqa: E731
        _wait(lambda: bool(alone()), "the survivor's first step")
        first = alone()[0]
        process = next(e for e in _events(events) if e["event"] == "process" and e["pid"] == first["pid"])
        set_up = next(e for e in _events(events) if e["event"] == "set-up" and e["pid"] == first["pid"])
        chosen = _logged(work / "agent-a.log", "resuming from s3://", killed)
        loaded = _logged(work / "agent-a.log", "resumed from", killed)
        resumed_step = first["step"] - 1
    finally:
        for agent in agents:
            kill_with_descendants(agent.pid)
    parts = {
        "failure_to_new_process": process["time"] - killed,
        "process_to_checkpoint_downloaded": chosen - process["time"],
        "downloaded_to_set_up_done": set_up["time"] - chosen,
        "set_up_to_checkpoint_loaded": loaded - set_up["time"],
        "loaded_to_first_step_done": first["time"] - loaded,
    }
    return {
        "parts_seconds": {name: round(value, 2) for name, value in parts.items()},
        "failure_to_first_step_seconds": round(first["time"] - killed, 2),
        "killed_after_step": killed_at_step,
        "resumed_after_step": resumed_step,
        "steps_done_again": killed_at_step - resumed_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=20, help="checkpoint_every_n_steps")
    parser.add_argument("--kill-at", type=int, default=30, help="the step after which a node is lost")
    parser.add_argument("--train-size", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    server, _ = start_s3_server()
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="elastic-bench-") as folder:
            result = measure(Path(folder), args.every, args.kill_at, args.train_size)
    finally:
        server.terminate()
        server.wait()
    result = {
        "name": "elastic_restart",
        "what": (
            "torchrun --nnodes=1:2 (two elastic agents on loopback, c10d rendezvous), MiniLM fine_tune on TREC,"
            f" global batch 8, checkpoint_every_n_steps={args.every} to a bucket of moto's S3 server; one node"
            f" SIGKILLed after step {args.kill_at}; the other agent restarts its worker alone."
        ),
        "machine": machine(),
        **result,
        "bench_wall_seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic_restart.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {name.replace('_', ' ')} | {value:.2f} |" for name, value in result["parts_seconds"].items()]
    table = [
        "# A lost node under torchrun's elastic agent (`benchmarks/elastic_restart.py`)",
        "",
        result["what"],
        "",
        "| part of the restart | seconds |",
        "|---|---|",
        *rows,
        f"| **failure to the first step after it** | **{result['failure_to_first_step_seconds']:.2f}** |",
        "",
        f"Work lost: killed after step {result['killed_after_step']}, resumed after step"
        f" {result['resumed_after_step']}: {result['steps_done_again']} steps done again.",
        "",
    ]
    (args.out / "elastic_restart.md").write_text("\n".join(table))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
