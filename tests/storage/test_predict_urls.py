"""``flair_fabric.predict`` and ``python -m flair_fabric predict`` with their files in an S3 bucket (moto's server on
loopback, reached through s3fs): the output equals, byte for byte, that of the same run on local files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
from flair.datasets import ColumnCorpus
from flair.models import TextClassifier
from flair.tokenization import Tokenizer

import flair_fabric

from ..storage_server import BUCKET, SECRET, S3Server
from ..support import REPO, small_wnut, tiny_classifier_file, tiny_sequence_tagger

ONE = {"devices": 1, "accelerator": "cpu"}
TWO_FORKED = {"devices": 2, "accelerator": "cpu", "strategy": "ddp_fork"}
ONE_ON_THE_COMMAND_LINE = ["--devices", "1", "--accelerator", "cpu"]
BUCKET_OUT = f"s3://{BUCKET}/eval/results/pred.txt"  # a prefix that does not exist yet


@pytest.fixture(scope="module")
def classifier_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TREC classifier trained for one epoch, saved by flair."""
    return tiny_classifier_file(tmp_path_factory.mktemp("classifier"))


def _questions(count: int) -> bytes:
    lines = [f"What is the name of river number {n} ?" if n % 7 else "" for n in range(count)]  # blank lines too
    return ("\n".join(lines) + "\n").encode("utf-8")


def _objects(prefix: str) -> list[str]:
    """Every object under ``prefix``."""
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(fs.find(f"{BUCKET}/{prefix}"))


@pytest.mark.parametrize(
    "launch",
    [pytest.param(ONE, id="1-process"), pytest.param(TWO_FORKED, id="2-forked", marks=pytest.mark.multiprocess)],
)
def test_predict_from_and_to_the_bucket_equals_predict_from_and_to_local_files(
    s3: S3Server, classifier_file: Path, tmp_path: Path, launch: dict
) -> None:
    model = TextClassifier.load(classifier_file)
    text = _questions(90)
    (tmp_path / "in.txt").write_bytes(text)
    prefix = f"predict-{launch['devices']}"
    fsspec.filesystem("s3").pipe(f"s3://{BUCKET}/{prefix}/in.txt", text)
    local = flair_fabric.predict(
        model, str(tmp_path / "in.txt"), out_path=tmp_path / "out.conll", chunk_size=16, **launch
    )
    remote = flair_fabric.predict(
        model,
        f"s3://{BUCKET}/{prefix}/in.txt",
        out_path=f"s3://{BUCKET}/{prefix}/new/out.conll",  # a prefix that does not exist yet
        chunk_size=16,
        **launch,
    )
    written = fsspec.filesystem("s3").cat(f"s3://{BUCKET}/{prefix}/new/out.conll")
    expected = (tmp_path / "out.conll").read_bytes()
    assert expected.count(b"\n\n") == 90 - 13 and written == expected
    assert (remote.read, remote.predicted, remote.skipped) == (local.read, local.predicted, local.skipped)
    assert _objects(prefix) == [f"{BUCKET}/{prefix}/in.txt", f"{BUCKET}/{prefix}/new/out.conll"], "no temporary"
    assert SECRET.encode() not in written


class _FailingTokenizer(Tokenizer):
    """Splits at spaces; raises on its 40th line."""

    def __init__(self) -> None:
        self.calls = 0

    def tokenize(self, text: str) -> list[str]:
        self.calls += 1
        if self.calls == 40:
            raise RuntimeError("the 40th line")
        return text.split()


def test_a_failed_prediction_leaves_no_object_in_the_bucket(s3: S3Server, classifier_file: Path) -> None:
    """A job that fails while predicting (a tokenizer that raises on the 40th line) uploads nothing."""
    model = TextClassifier.load(classifier_file)
    fsspec.filesystem("s3").pipe(f"s3://{BUCKET}/failed/in.txt", _questions(60))
    tokenizer = _FailingTokenizer()
    with pytest.raises(RuntimeError, match="the 40th line"):
        flair_fabric.predict(
            model,
            f"s3://{BUCKET}/failed/in.txt",
            out_path=f"s3://{BUCKET}/failed/out.jsonl",
            tokenizer=tokenizer,
            **ONE,
        )
    assert _objects("failed") == [f"{BUCKET}/failed/in.txt"]


def test_the_command_line_predicts_with_a_model_from_the_bucket_as_from_and_to_local_files(
    s3: S3Server, classifier_file: Path, tmp_path: Path
) -> None:
    text = _questions(30)
    (tmp_path / "in.txt").write_bytes(text)
    fsspec.filesystem("s3").pipe(f"s3://{BUCKET}/cli/in.txt", text)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    target = f"s3://{BUCKET}/cli/results/out.jsonl"  # a prefix that does not exist yet
    fsspec.filesystem("s3").put_file(str(classifier_file), f"s3://{BUCKET}/cli/best-model.pt")  # the model too
    command = [sys.executable, "-m", "flair_fabric", "predict", "--model", f"s3://{BUCKET}/cli/best-model.pt"]
    command += ["--input", f"s3://{BUCKET}/cli/in.txt", "--output", target, "--devices", "1", "--accelerator", "cpu"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "25 predicted, 5 skipped" in done.stdout and SECRET not in done.stdout + done.stderr
    model = TextClassifier.load(classifier_file)  # the reference: the same prediction between local files
    flair_fabric.predict(model, str(tmp_path / "in.txt"), out_path=tmp_path / "out.jsonl", tokenizer=True, **ONE)
    outputs = [(tmp_path / "out.jsonl").read_bytes(), fsspec.filesystem("s3").cat(target)]
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == 25


def test_the_command_line_evaluates_a_file_in_the_bucket_and_writes_its_output_there(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluate --input s3://... --output s3://...`` scores what the same command scores on local files (flair's
    own ``evaluate`` is the reference) and puts the same prediction file into the bucket, nothing on local disk."""
    from flair.datasets import ColumnDataset
    from flair.models import SequenceTagger

    from flair_fabric.cli import main

    small_wnut(tmp_path / "wnut", train_size=20, dev_size=2, test_size=2)
    corpus = ColumnCorpus(tmp_path / "wnut", {0: "text", 1: "ner"}, column_delimiter="\t")
    tiny_sequence_tagger(corpus).save(tmp_path / "tagger.pt")
    gold = tmp_path / "wnut" / "train.txt"
    fsspec.filesystem("s3").put_file(str(gold), f"s3://{BUCKET}/eval/gold.txt")
    monkeypatch.chdir(tmp_path)  # where a URL taken for a local path would land
    common = ["--model", str(tmp_path / "tagger.pt"), "--gold-label-type", "ner", "--json", *ONE_ON_THE_COMMAND_LINE]
    scores = []
    for source, target in ((str(gold), str(tmp_path / "pred.txt")), (f"s3://{BUCKET}/eval/gold.txt", BUCKET_OUT)):
        try:
            assert main(["evaluate", "--input", source, "--output", target, *common]) == 0
        except (OSError, SystemExit) as error:
            pytest.fail(f"evaluate --input {source} --output {target} failed: {error!r}")
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["main_score"])
    reference = SequenceTagger.load(tmp_path / "tagger.pt").evaluate(ColumnDataset(gold, {0: "text", 1: "ner"}), "ner")
    assert scores == [pytest.approx(reference.main_score)] * 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pred.txt", "tagger.pt", "wnut"], "nothing else here"
    assert fsspec.filesystem("s3").exists(BUCKET_OUT), "the prediction file reached the bucket"
    assert fsspec.filesystem("s3").cat(BUCKET_OUT) == (tmp_path / "pred.txt").read_bytes()
    assert (tmp_path / "pred.txt").stat().st_size > 0
