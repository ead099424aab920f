"""What a ``base_path`` in an S3 bucket costs training: step checkpoints every 50 steps uploaded in the background.

One process, MiniLM (``fine_tune``: AdamW, linear schedule), ``devices=1``, 150 steps per epoch: the training part of
an epoch (``before_training_epoch`` to ``after_training_epoch``; the checkpoints after steps 50 and 100 fall inside
it) with no checkpoint, with checkpoints to a local folder, and with checkpoints to a bucket of moto's S3 server (its
own process on loopback, reached through s3fs), in rotating order after an untimed warm-up. Also the upload
bandwidth of one checkpoint to that server.

    python benchmarks/store_checkpoints.py [--quick]

Results: ``benchmarks/results/store_checkpoints.{json,md}``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import build_model, machine, quiet_flair, train_only_corpus  # noqa: E402

BUCKET = "bench"
ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "bench-key",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_s3_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process on a free loopback port, with the bucket made."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update({**ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint})
    import fsspec

    fsspec.filesystem("s3").mkdir(BUCKET)
    return server, endpoint


class _Times:
    """The training part of each epoch (the ``EpochTimer`` of benchmarks/common.py, here without pickling)."""

    def __init__(self) -> None:
        from flair.trainers.plugins import TrainerPlugin

        times = self

        class Timer(TrainerPlugin):
            @TrainerPlugin.hook
            def before_training_epoch(self, **kw: Any) -> None:
                times.started = time.perf_counter()

            @TrainerPlugin.hook
            def after_training_epoch(self, **kw: Any) -> None:
                times.seconds.append(time.perf_counter() - times.started)

        self.started = 0.0
        self.seconds: list[float] = []
        self.plugin = Timer()


def one_epoch(variant: str, corpus: Any, work: Path, number: int, batch_size: int, every: int) -> float:
    """The training seconds of one epoch of a fresh MiniLM classifier under ``variant``."""
    from flair_fabric import FabricTrainer

    base = {"none": work / f"none-{number}", "local": work / f"local-{number}"}.get(
        variant, f"s3://{BUCKET}/run-{number}"
    )
    checkpoints = {} if variant == "none" else {"checkpoint_every_n_steps": every, "keep_checkpoints": 1}
    times = _Times()
    FabricTrainer(build_model("minilm", corpus), corpus).fine_tune(
        base,
        learning_rate=5e-5,
        mini_batch_size=batch_size,
        max_epochs=1,
        shuffle=False,
        plugins=[times.plugin],
        create_file_logs=False,
        create_loss_file=False,
        save_final_model=False,
        use_final_model_for_eval=True,
        accelerator="cpu",
        devices=1,
        progress_bar=False,
        **checkpoints,
    )
    return times.seconds[0]


def upload_bandwidth(work: Path) -> dict[str, float]:
    """Seconds and MB/s of one put of the newest local checkpoint's files to the bucket."""
    import fsspec

    folder = max((work / "local-0" / "checkpoints").glob("step-*"))
    files = [path for path in folder.rglob("*") if path.is_file()]
    size = sum(path.stat().st_size for path in files)
    fs = fsspec.filesystem("s3")
    started = time.perf_counter()
    for path in files:
        fs.put_file(str(path), f"{BUCKET}/bandwidth/{path.name}")
    seconds = time.perf_counter() - started
    return {
        "checkpoint_mb": round(size / 1e6, 1),
        "upload_seconds": round(seconds, 2),
        "mb_per_s": round(size / 1e6 / seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round instead of three")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one core trains; the other is left to the upload and the S3 server, as beside a GPU
    quiet_flair()
    batch_size, steps, every = 8, 150, 50
    corpus = train_only_corpus(batch_size * steps)
    server, _ = start_s3_server()
    started = time.time()
    seconds: dict[str, list[float]] = {"none": [], "local": [], "bucket": []}
    try:
        with tempfile.TemporaryDirectory(prefix="store-bench-") as folder:
            work = Path(folder)
            os.environ["FLAIR_FABRIC_STAGING"] = str(work / "staging")
            one_epoch("bucket", corpus, work, 99, batch_size, every)  # warm-up: imports, caches, the server
            rounds = 1 if args.quick else 3
            orders = [("none", "local", "bucket"), ("bucket", "none", "local"), ("local", "bucket", "none")]
            for number in range(rounds):
                for variant in orders[number % 3]:
                    seconds[variant].append(one_epoch(variant, corpus, work, number, batch_size, every))
                    print(f"round {number} {variant}: {seconds[variant][-1]:.2f} s", flush=True)
            bandwidth = upload_bandwidth(work)
    finally:
        server.terminate()
        server.wait()
    medians = {variant: statistics.median(values) for variant, values in seconds.items()}
    result = {
        "name": "store_checkpoints",
        "what": (
            "FabricTrainer(accelerator='cpu', devices=1).fine_tune of MiniLM, 150 steps of 8 TREC questions, one torch"
            " thread: the training part of one epoch with no checkpoint, with checkpoint_every_n_steps=50 to a local"
            " base_path, and to base_path=s3://... on moto's S3 server (its own process on loopback); the checkpoints"
            " after steps 50 and 100 fall inside the timed part; rotating order after a warm-up."
        ),
        "machine": machine(),
        "seconds": {variant: [round(x, 3) for x in values] for variant, values in seconds.items()},
        "median_seconds": {variant: round(value, 3) for variant, value in medians.items()},
        "bucket_over_none": round(medians["bucket"] / medians["none"], 4),
        "local_over_none": round(medians["local"] / medians["none"], 4),
        "upload": bandwidth,
        "bench_wall_seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_checkpoints.json").write_text(json.dumps(result, indent=2) + "\n")
    table: list[str] = [
        "# Checkpoints to an S3 bucket during training (`benchmarks/store_checkpoints.py`)",
        "",
        str(result["what"]),
        "",
        "| checkpoints | epoch seconds (median) | ratio to none |",
        "|---|---|---|",
        *(
            f"| {variant} | {medians[variant]:.2f} | {medians[variant] / medians['none']:.3f} |"
            for variant in ("none", "local", "bucket")
        ),
        "",
        f"One checkpoint: {bandwidth['checkpoint_mb']} MB, uploaded in {bandwidth['upload_seconds']} s"
        f" ({bandwidth['mb_per_s']} MB/s to the local server).",
        "",
    ]
    (args.out / "store_checkpoints.md").write_text("\n".join(table))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
