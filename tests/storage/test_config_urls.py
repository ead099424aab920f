"""``python -m flair_fabric train s3://bucket/run.yaml``: a config file in the bucket is checked as a local one, and
its mistakes name ``s3://bucket/run.yaml:LINE`` (the line counted in the text written here)."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import yaml

from flair_fabric.datasets import TREC
from flair_fabric.shell.command import checked_config
from flair_fabric.shell.errors import ConfigError

from ..shell.test_config_checks import CONFIG
from ..storage_server import BUCKET, KEY_ID, SECRET, S3Server


def _put(name: str, text: str) -> str:
    url = f"s3://{BUCKET}/configs/{name}"
    fsspec.filesystem("s3").pipe(url, text.encode("utf-8"))
    return url


def _line_of(text: str, part: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if part in line)


def test_a_config_in_the_bucket_passes_the_checks_and_a_local_file_may_override_it(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture
) -> None:
    url = _put("run.yaml", CONFIG)
    _, config, _ = checked_config([url])
    assert (config.trainer.method, config.trainer.max_epochs, config.seed) == ("fine_tune", 2, 3)
    assert config.corpus.init_args.train_size == 24
    override = tmp_path_factory.mktemp("local") / "more.yaml"
    override.write_text("trainer:\n  max_epochs: 5\n", encoding="utf-8")
    _, config, _ = checked_config([url, str(override)])
    assert config.trainer.max_epochs == 5
    with pytest.raises(SystemExit):
        checked_config([url, "--print_config"])
    printed = capsys.readouterr().out
    resolved = yaml.safe_load(printed)
    assert resolved["trainer"]["max_epochs"] == 2 and resolved["corpus"]["init_args"]["train_size"] == 24
    assert SECRET not in printed and "config" not in resolved


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (("max_epochs: 2", "max_epochs: two"), "trainer.max_epochs"),
        (("model:", "modle:"), "modle"),
        (("train_size: 24", "train_size: many"), "corpus.init_args.train_size"),
    ],
)
def test_a_mistake_in_a_config_in_the_bucket_names_its_url_and_line(
    s3: S3Server, change: tuple[str, str], key: str
) -> None:
    text = CONFIG.replace(*change)
    url = _put("wrong.yaml", text)
    with pytest.raises(ConfigError) as refused:
        checked_config([url])
    assert str(refused.value).startswith(f"{url}:{_line_of(text, change[1])}: {key}:"), str(refused.value)


def test_a_yaml_mistake_or_a_missing_config_in_the_bucket_is_one_line_naming_the_url(s3: S3Server) -> None:
    text = CONFIG.replace("max_epochs: 2", "max_epochs: [2")
    url = _put("broken.yaml", text)
    with pytest.raises(ConfigError) as refused:
        checked_config([url])
    assert str(refused.value).startswith(f"{url}:{_line_of(text, 'max_epochs: [2')}: YAML syntax error")
    missing = f"s3://{BUCKET}/configs/absent.yaml"
    with pytest.raises(ConfigError) as refused:
        checked_config([missing])
    assert str(refused.value) == f"config file={missing!r}: no such file."


def test_a_config_run_into_the_bucket_keeps_its_config_there_and_a_changed_resume_is_refused(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.base_path an s3:// URL reached through trainer.storage_options alone (no credentials or endpoint in
    the environment): the run's config.yaml, loss.tsv and final-model.pt land in the bucket, and no object, staged
    file or tracker's file holds the credential (config.yaml has storage_options: null); a resume with a changed
    learning rate, on a machine folder that never saw the run, is refused by the config.yaml read from the bucket;
    one with more epochs continues from the bucket's checkpoint."""
    import s3fs

    from flair_fabric.shell.command import train

    from ..shell.test_config_runs import _small
    from ..support import make_tiny_bert

    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(tmp_path / "first"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    s3fs.S3FileSystem.clear_instance_cache()
    options = {"key": KEY_ID, "secret": SECRET, "endpoint_url": s3.endpoint}
    bert = make_tiny_bert(tmp_path / "bert", TREC(train_size=24, dev_size=8, test_size=8))
    url = f"s3://{BUCKET}/config-run"
    once = ["--trainer.max_epochs=1", "--trainer.checkpoint_every_n_epochs=1", "--trainer.global_batch_size=8"]
    once.append(f"--trainer.storage_options={json.dumps(options)}")
    once.append(f"--loggers=[{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {tmp_path}}}}}]")
    train([*_small("trec.yaml", bert, tmp_path / "unused", *once), f"--trainer.base_path={url}"])
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    names = {path.rsplit("/", 1)[-1] for path in fs.find(f"{BUCKET}/config-run", maxdepth=1)}
    assert {"config.yaml", "loss.tsv", "final-model.pt"} <= names, names
    written = fs.cat_file(f"{url}/config.yaml").decode()
    assert yaml.safe_load(written)["trainer"]["base_path"] == url and SECRET not in written
    assert yaml.safe_load(written)["trainer"]["storage_options"] is None
    holding = [path for path in fs.find(f"{BUCKET}/config-run") if SECRET.encode() in fs.cat_file(path)]
    holding += [str(path) for path in tmp_path.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()]
    assert not holding, "a credential written"
    assert list(tmp_path.rglob("hparams.yaml")), "the tracker got the run's parameters"
    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(tmp_path / "second"))
    changed = [*once, "--trainer.resume_from=auto", "--trainer.learning_rate=0.5", f"--trainer.base_path={url}"]
    with pytest.raises(ConfigError, match=r"trainer.learning_rate \(0.0001 -> 0.5\)"):
        train(_small("trec.yaml", bert, tmp_path / "unused", *changed))
    more = ["--trainer.max_epochs=2", *once[1:], "--trainer.resume_from=auto", f"--trainer.base_path={url}"]
    train(_small("trec.yaml", bert, tmp_path / "unused", *more))
    rows = fs.cat_file(f"{url}/loss.tsv").decode().splitlines()
    assert [row.split("\t")[0] for row in rows[1:]] == ["1", "2"], "the resumed run added its second epoch"


def test_a_config_corpus_may_read_its_data_folder_from_the_bucket(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config's mapped corpus whose data_folder is a URL passes the checks and is made from the bucket's files (as
    from the same files on local disk); one whose bucket does not exist is refused naming the key, its line and the
    fix."""
    from flair_fabric.data import MappedCorpus
    from flair_fabric.datasets import WNUT16

    from ..shell.test_config_checks import _write

    monkeypatch.setenv("FLAIR_FABRIC_CACHE", str(tmp_path / "cache"))
    WNUT16(train_size=12, dev_size=4, test_size=4, split_files_to=tmp_path / "ner")
    fs = fsspec.filesystem("s3")
    for file in sorted((tmp_path / "ner").iterdir()):
        fs.put_file(str(file), f"{BUCKET}/config-ner/{file.name}")
    text = """\
corpus:
  class_path: flair_fabric.data.MappedCorpus.from_column_files
  init_args:
    data_folder: DATA
    column_format: {0: text, 1: ner}
    column_delimiter: "\\t"
model:
  class_path: flair.models.SequenceTagger
  init_args: {tag_type: ner}
trainer:
  base_path: out
"""
    config = _write(tmp_path, text.replace("DATA", f"s3://{BUCKET}/config-ner"))
    try:
        parser, _, given = checked_config([str(config)])
    except ConfigError as error:
        pytest.fail(f"a data folder in the bucket was refused: {error}")
    made = parser.instantiate_classes(given).corpus
    local = MappedCorpus.from_column_files(tmp_path / "ner", {0: "text", 1: "ner"}, column_delimiter="\t")
    assert isinstance(made, MappedCorpus)
    assert [len(made.train), len(made.dev), len(made.test)] == [len(local.train), len(local.dev), len(local.test)]
    tagged = [[corpus.train[i].to_tagged_string() for i in range(12)] for corpus in (made, local)]
    assert tagged[0] == tagged[1]
    missing = _write(tmp_path, text.replace("DATA", "s3://no-such-bucket/ner"), "missing.yaml")
    with pytest.raises(ConfigError) as refused:
        checked_config([str(missing)])
    line = _line_of(missing.read_text(), "data_folder")
    assert str(refused.value).startswith(f"{missing}:{line}: corpus.init_args.data_folder='s3://no-such-bucket/ner'")
    assert "does not exist" in str(refused.value)
