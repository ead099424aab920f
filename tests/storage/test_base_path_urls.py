"""``base_path`` in an S3 bucket (moto's server on loopback, reached through s3fs): a run killed mid-epoch resumes on
another machine folder from the bucket alone, to the weights of an uninterrupted run; only checkpoints with their
completion marker are read; the marker comes last, after every machine's part; uploads do not block training; no
credential is written anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from flair.models import TextClassifier
from torch.multiprocessing.spawn import ProcessExitedException

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric.state.run_store import MARKER, DamagedCheckpoint, RunStore
from flair_fabric.state.store_resume import checkpoint_in_store_to_resume
from flair_fabric.state.uploads import Uploads
from flair_fabric.storage import StorageError

from ..plugin_support import KillAtStep
from ..storage_server import BUCKET, KEY_ID, SECRET, S3Server
from ..support import (
    REPO,
    SCRIPTS,
    free_port,
    kill_with_descendants,
    no_training_may_start,
    script_env,
    small_trec,
    state_dict_difference,
    tiny_text_classifier,
)
from .test_elastic_torchrun import TORCHRUN

SETTINGS: dict[str, Any] = {
    "learning_rate": 0.05,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "accelerator": "cpu",
    "global_batch_size": 6,
    "max_epochs": 3,
}


def _objects(prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` of the bucket, with its bytes."""
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return {path: fs.cat_file(path) for path in fs.find(f"{BUCKET}/{prefix}")}


def _staged_in(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Path:
    """This "machine"'s staging folder root."""
    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(folder))
    return folder


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_fork", "fsdp"])
def test_a_run_killed_mid_epoch_resumes_from_the_bucket_on_a_fresh_machine_to_the_uninterrupted_weights(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, strategy: str
) -> None:
    """2 forked ranks (DDP, or FSDP with its sharded checkpoints: a part per rank) train into s3://bucket/killed-...
    with a checkpoint every 2 steps and are SIGKILLed at step 11 (of 24, in epoch 2 of 3). The run resumes with
    resume_from="auto" from the bucket alone, on machine folders that never saw it: DDP's on one process; FSDP's on
    two torchrun machines (each downloads the sharded checkpoint every rank reads), which reach the bucket through
    storage_options only. The weights are those of an uninterrupted run (within 1e-5), the bucket's loss.tsv has its
    train losses, final-model.pt in the bucket loads in flair and holds the trained weights; no credential is in any
    object, staged file or log line."""
    corpus = small_trec(train_size=45)
    whole = tiny_text_classifier(corpus)
    FabricTrainer(whole, corpus).fine_tune(tmp_path / "whole", devices=1, **SETTINGS)
    url = f"s3://{BUCKET}/killed-{strategy}"
    _staged_in(monkeypatch, tmp_path / "first-machine")
    launch = FlairFSDPStrategy(start_method="fork") if strategy == "fsdp" else strategy
    with pytest.raises(ProcessExitedException, match=r"SIGKILL|signal 9"):
        FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(
            url,
            devices=2,
            strategy=launch,
            checkpoint_every_n_steps=2,
            keep_checkpoints=3,  # "auto" must take the newest of several
            plugins=[KillAtStep(11)],
            **SETTINGS,
        )
    store = RunStore.of(url)
    complete = store.complete_checkpoints()
    assert len(complete) >= 2 and complete[-1] <= "step-000000010", complete

    second_machine = _staged_in(monkeypatch, tmp_path / "second-machine")
    assert not second_machine.exists()
    resumed = tiny_text_classifier(corpus)
    if strategy == "fsdp":  # every rank reads a sharded checkpoint: each of two machines needs its own copy
        logs = _resume_with_fsdp_on_two_machines(url, tmp_path, s3)
        resumed.load_state_dict(torch.load(tmp_path / "two-machines" / "final.pt"))
        on_second = RunStore.of(url).local.parent.parent / "machine-1" / RunStore.of(url).local.name
        listed = store.read_marker(complete[-1])["files"]
        copies = {name: on_second / "checkpoints" / complete[-1] / name for name in listed}
        copied = {name: path.stat().st_size if path.is_file() else None for name, path in copies.items()}
        assert copied == listed, "machine 1 reads its own copy of the checkpoint"
    else:
        with caplog.at_level("INFO", logger="flair"):
            FabricTrainer(resumed, corpus).fine_tune(url, devices=1, resume_from="auto", **SETTINGS)
        logs = caplog.text
    assert f"resuming from {url}/checkpoints/{complete[-1]}" in logs
    assert state_dict_difference(resumed.state_dict(), whole.state_dict()) <= 1e-5

    objects = _objects(f"killed-{strategy}")
    if strategy == "fsdp":  # a sharded checkpoint: a folder of parts, all listed in the marker
        listed = store.read_marker(complete[-1])["files"]
        assert any(name.startswith("state.ckpt/") and name.endswith(".distcp") for name in listed), listed
    rows = [line.split("\t") for line in objects[f"{BUCKET}/killed-{strategy}/loss.tsv"].decode().splitlines()]
    expected = [line.split("\t") for line in (tmp_path / "whole" / "loss.tsv").read_text().splitlines()]
    column = rows[0].index("TRAIN_LOSS")
    assert [float(row[column]) for row in rows[1:]] == pytest.approx([float(row[column]) for row in expected[1:]])
    staging = RunStore.of(url).local  # global rank 0's staging folder: its final test is in the bucket too
    if strategy == "fsdp":
        staging = staging.parent.parent / "machine-0" / staging.name
    assert f"{BUCKET}/killed-{strategy}/test.tsv" in objects, sorted(objects)
    assert objects[f"{BUCKET}/killed-{strategy}/test.tsv"] == (staging / "test.tsv").read_bytes()
    final = tmp_path / "final-model.pt"
    final.write_bytes(objects[f"{BUCKET}/killed-{strategy}/final-model.pt"])
    assert state_dict_difference(TextClassifier.load(final).state_dict(), resumed.state_dict()) == 0.0

    secret = SECRET.encode()
    assert not [path for path, data in objects.items() if secret in data], "a credential in the bucket"
    given = tmp_path / "two-machines" / "config.json"  # the credentials the test gave the two machines
    staged = [path for path in tmp_path.rglob("*") if path != given and path.is_file() and secret in path.read_bytes()]
    assert not staged, "a credential in a staged file or a log"
    assert SECRET not in logs


def _resume_with_fsdp_on_two_machines(url: str, tmp_path: Path, s3: S3Server) -> str:
    """Resume the run in ``url`` ("auto") with FSDP on two "machines": a torchrun agent each (one process each, node
    ranks 0 and 1), each with its own staging folder and no credentials or endpoint in its environment: the bucket
    is reached through ``storage_options`` alone. Returns their output."""
    out = tmp_path / "two-machines"
    out.mkdir()
    options = {"key": KEY_ID, "secret": SECRET, "endpoint_url": s3.endpoint}
    kwargs = {**SETTINGS, "strategy": "fsdp", "devices": 1, "num_nodes": 2, "storage_options": options}
    config = {"out": str(out), "base_path": url, "kwargs": kwargs, "step_seconds": 0, "optimizer": "AdamW"}
    (out / "config.json").write_text(json.dumps({**config, "train_size": 45}))

    port, machines = free_port(), []
    for node in (0, 1):
        env = script_env(FLAIR_FABRIC_STAGING=str(tmp_path / f"machine-{node}"))
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
            env.pop(name)
        rendezvous = ["--nnodes=2", f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        command = [TORCHRUN, *rendezvous, "--nproc_per_node=1", str(SCRIPTS / "elastic_training.py")]
        machines.append(
            subprocess.Popen(
                [*command, str(out / "config.json")],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        outputs = [machine.communicate(timeout=300)[0] for machine in machines]
    finally:
        for machine in machines:
            kill_with_descendants(machine.pid)
    output = "\n".join(outputs)
    assert [machine.returncode for machine in machines] == [0, 0], output[-6000:]
    return output


def _checkpoint_folder(folder: Path, size: int) -> Path:
    """A checkpoint-like folder: one large file and two small ones."""
    folder.mkdir(parents=True)
    (folder / "state.ckpt").write_bytes(os.urandom(size))
    (folder / "extras.pt").write_bytes(b"extras")
    (folder / "progress.json").write_text("{}")
    return folder


def test_the_marker_comes_after_every_file_and_the_upload_does_not_block(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24 MB checkpoint uploaded by Uploads: the call returns before the upload is done (no marker yet), and an
    observer polling the bucket never sees the marker while a file it lists is missing or short."""
    _staged_in(monkeypatch, tmp_path / "staging")
    store = RunStore.of(f"s3://{BUCKET}/ordering")
    folder = _checkpoint_folder(tmp_path / "step-000000004", 24 * 2**20)
    uploads = Uploads(store, node_rank=0, num_nodes=1, is_global_zero=True, keep=2, timeout=60)
    seen: list[str] = []
    done = threading.Event()

    def observe() -> None:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        while not done.is_set():
            fs.invalidate_cache()
            found = {path.rsplit("/", 1)[-1]: fs.info(path)["size"] for path in fs.find(store.checkpoint_url(""))}
            if MARKER in found:
                listed = json.loads(fs.cat_file(f"{store.checkpoint_url('step-000000004')}/{MARKER}"))["files"]
                seen.append("complete" if all(found.get(name) == size for name, size in listed.items()) else "early")
            else:
                seen.append("incomplete")
            time.sleep(0.02)

    observer = threading.Thread(target=observe)
    observer.start()
    try:
        time.sleep(0.1)
        uploads.checkpoint(folder, "step-000000004")
        returned_before_marker = store.complete_checkpoints() == []
        uploads.finish()
        time.sleep(0.1)
    finally:
        done.set()
        observer.join()
    assert returned_before_marker, "the upload blocked the training thread"
    assert "early" not in seen, "the marker was there before every file of the checkpoint"
    assert store.complete_checkpoints() == ["step-000000004"]
    assert seen[-1] == "complete"


def test_the_marker_waits_for_every_machines_part(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two machines' parts of one checkpoint: global rank 0's own part is not enough; the marker comes once the other
    machine's part is there, and it lists the files of both."""
    _staged_in(monkeypatch, tmp_path / "staging")
    store = RunStore.of(f"s3://{BUCKET}/two-machines")
    mine = _checkpoint_folder(tmp_path / "node-0" / "step-000000002", 1000)
    theirs = tmp_path / "node-1" / "step-000000002"
    theirs.mkdir(parents=True)
    (theirs / "__1_0.distcp").write_bytes(b"shard of rank 1")
    zero = Uploads(store, node_rank=0, num_nodes=2, is_global_zero=True, keep=2, timeout=60)
    one = Uploads(store, node_rank=1, num_nodes=2, is_global_zero=False, keep=2, timeout=60)
    zero.checkpoint(mine, "step-000000002")
    time.sleep(1.5)
    assert store.complete_checkpoints() == [], "complete without the other machine's part"
    one.checkpoint(theirs, "step-000000002")
    one.finish()
    zero.finish()
    assert store.complete_checkpoints() == ["step-000000002"]
    listed = store.read_marker("step-000000002")["files"]
    assert sorted(listed) == ["__1_0.distcp", "extras.pt", "progress.json", "state.ckpt"]


def test_a_checkpoint_changed_after_its_marker_is_refused_and_nothing_of_it_is_kept(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete checkpoint whose state.ckpt was cut short in the bucket after its marker was written (another
    program, a bad copy): the download refuses it by the marker's sizes, naming the object, and leaves nothing
    staged for a resume to read."""
    _staged_in(monkeypatch, tmp_path / "staging")
    store = RunStore.of(f"s3://{BUCKET}/changed")
    uploads = Uploads(store, node_rank=0, num_nodes=1, is_global_zero=True, keep=2, timeout=60)
    uploads.checkpoint(_checkpoint_folder(tmp_path / "written" / "step-000000002", 5000), "step-000000002")
    uploads.finish()
    url = store.checkpoint_url("step-000000002")
    fsspec.filesystem("s3").pipe_file(f"{url}/state.ckpt", b"cut short")
    _staged_in(monkeypatch, tmp_path / "fresh")
    store = RunStore.of(store.url)
    with pytest.raises(DamagedCheckpoint, match=rf"{url}/state.ckpt has 9 bytes, .* says 5000"):
        store.download_checkpoint("step-000000002")
    staged = [path for path in (tmp_path / "fresh").rglob("*") if path.is_file()]
    assert not staged, staged


def test_auto_skips_a_checkpoint_without_its_marker_and_keep_removes_only_complete_ones(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with a checkpoint after each of 3 epochs (keep 2); the newest one's marker removed, as an upload cut off
    leaves it: "auto" resumes from the one before, an explicit URL of the cut one is refused, and a run that keeps
    one checkpoint removes the complete older ones but not the cut one."""
    _staged_in(monkeypatch, tmp_path / "staging")
    corpus = small_trec(train_size=12)
    url = f"s3://{BUCKET}/cut"
    options = {**SETTINGS, "global_batch_size": 6, "checkpoint_every_n_epochs": 1, "keep_checkpoints": 2}
    FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(url, devices=1, **options)
    store = RunStore.of(url)
    assert store.complete_checkpoints() == ["step-000000004", "step-000000006"]
    fs = fsspec.filesystem("s3")
    fs.rm_file(f"{store.checkpoint_url('step-000000006')}/{MARKER}")
    assert fs.exists(f"{store.checkpoint_url('step-000000006')}/state.ckpt"), "its parts stay"
    _staged_in(monkeypatch, tmp_path / "fresh")
    store = RunStore.of(url)
    folder, epoch = checkpoint_in_store_to_resume(store, tiny_text_classifier(corpus), 0, "auto", download=True)
    assert (folder.name if folder else None, epoch) == ("step-000000004", 2)
    with pytest.raises(ValueError, match=r"step-000000006 has no completion marker"):
        checkpoint_in_store_to_resume(
            store, tiny_text_classifier(corpus), 0, store.checkpoint_url("step-000000006"), download=True
        )
    resumed = tiny_text_classifier(corpus)
    FabricTrainer(resumed, corpus).fine_tune(url, devices=1, resume_from="auto", **{**options, "max_epochs": 4})
    assert store.complete_checkpoints() == ["step-000000006", "step-000000008"]
    cut = [store.checkpoint_url(name) for name in ("step-000000005", "step-000000009")]  # uploads cut off
    for folder in cut:
        fs.pipe_file(f"{folder}/state.ckpt", b"a part without its marker")
    store.prune(1)
    fs.invalidate_cache()
    assert store.complete_checkpoints() == ["step-000000008"]
    assert all(fs.exists(f"{folder}/state.ckpt") for folder in cut), "keep_checkpoints removed an incomplete one"


@pytest.mark.parametrize(
    ("base_path", "message"),
    [
        ("s3://no-such-bucket/run", r"base_path='s3://no-such-bucket/run': no-such-bucket does not exist"),
        ("nosuch://bucket/run", r"base_path='nosuch://bucket/run': unknown URL scheme nosuch://"),
        ("gs://bucket/run", r"base_path='gs://bucket/run': gs:// needs gcsfs.*flair-fabric\[gcs\]"),
    ],
    ids=["missing-bucket", "unknown-scheme", "not-installed"],
)
def test_a_base_path_url_that_cannot_be_used_is_refused_before_anything_starts(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base_path: str, message: str
) -> None:
    _staged_in(monkeypatch, tmp_path / "staging")
    no_training_may_start(monkeypatch)
    corpus = small_trec(train_size=12)
    with pytest.raises(StorageError, match=message):
        FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(base_path, devices=1, **SETTINGS)
    assert not (tmp_path / "staging").exists(), "nothing was staged"


def test_storage_options_that_cannot_be_used_are_refused_before_anything_starts(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storage_options beside a local base_path, or of the wrong kind: each refused before a process starts, naming
    the argument and the fix."""
    _staged_in(monkeypatch, tmp_path / "staging")
    no_training_may_start(monkeypatch)
    corpus = small_trec(train_size=12)
    trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
    with pytest.raises(
        ValueError, match=r"storage_options are for a base_path in a store .* leave storage_options out"
    ):
        trainer.fine_tune(tmp_path / "local", devices=1, storage_options={"anon": True}, **SETTINGS)
    with pytest.raises(ValueError, match=r"storage_options must be a dict .* not str"):
        trainer.fine_tune(f"s3://{BUCKET}/run", devices=1, storage_options="anon=true", **SETTINGS)
    assert not (tmp_path / "staging").exists() and not (tmp_path / "local").exists(), "nothing was staged"


def test_no_credentials_are_refused_before_anything_starts(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    _staged_in(monkeypatch, tmp_path / "staging")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    s3fs.S3FileSystem.clear_instance_cache()
    no_training_may_start(monkeypatch)
    corpus = small_trec(train_size=12)
    with pytest.raises(StorageError, match=r"base_path='s3://bucket/run': no credentials found"):
        FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(f"s3://{BUCKET}/run", devices=1, **SETTINGS)


def test_a_read_only_bucket_is_refused_before_anything_starts_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket these credentials may read but not write (moto checking an IAM policy): base_path there is refused
    before any process starts, naming base_path and the fix, and the bucket holds what it held."""
    import s3fs

    from .read_only_server import READ_ONLY_BUCKET, read_only_bucket

    _staged_in(monkeypatch, tmp_path / "staging")
    no_training_may_start(monkeypatch)
    corpus = small_trec(train_size=12)
    with read_only_bucket({"kept.txt": "kept"}) as options:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
        monkeypatch.setenv("AWS_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        s3fs.S3FileSystem.clear_instance_cache()
        url = f"s3://{READ_ONLY_BUCKET}/run"
        with pytest.raises(StorageError, match=rf"base_path='{url}' cannot be written .*: use a bucket and prefix"):
            FabricTrainer(tiny_text_classifier(corpus), corpus).fine_tune(url, devices=1, **SETTINGS)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        assert fs.find(READ_ONLY_BUCKET) == [f"{READ_ONLY_BUCKET}/kept.txt"]
    assert not (tmp_path / "staging").exists()
