"""A run from its resolved config (``--print_config``, ``base_path/config.yaml``) is the same run: every class and the
trainer receive the same arguments, for every default of every class the example configs and the tests' configs use,
and for values YAML reads in more than one way (``#``, ``:``, leading spaces, empty strings, ``None``, ``1e-5``,
tuples, enums, paths)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flair_fabric.shell.command import checked_config
from flair_fabric.shell.errors import ConfigError

from ..support import REPO
from .arguments import what_the_run_receives
from .test_config_checks import CONFIG

EXAMPLES = REPO / "examples" / "configs"

COLUMNS = "# sent_id = 1\nThe AT\ncat NN\n\n# sent_id = 2\nA AT\ndog NN\nruns VB\n\n"

AWKWARD_VALUES = """\
corpus:
  class_path: flair_fabric.data.MappedCorpus.from_column_files
  init_args:
    data_folder: {data}
    column_format: {{0: text, 1: pos}}
    comment_symbol: "#: "
    column_delimiter: " "
    name: ""
    label_name_map: {{"a: b": " leading space", "#x": "1e-5", "y": "null", "z": "~"}}
    cache_folder: {cache}
model:
  class_path: flair.models.SequenceTagger
  init_args:
    tag_type: pos
    hidden_size: 8
    loss_weights: {{"O": 1e-5}}
    rnn_type: " GRU"
dictionary:
  min_count: 2
trainer:
  base_path: {out}
  main_evaluation_metric: [macro avg, f1-score]
  learning_rate: 1e-5
  requeue_signal: SIGTERM
  exclude_labels: ["# ", "", ": "]
  global_batch_size: 8
"""

MAPPED = """\
corpus:
  class_path: flair_fabric.data.MappedCorpus.from_column_files
  init_args:
    data_folder: {data}
    column_format: {{0: text, 1: pos}}
    cache_folder: {cache}
model:
  class_path: flair.models.SequenceTagger
  init_args: {{tag_type: pos, hidden_size: 8}}
trainer:
  base_path: {out}
"""

FROM_THE_CORPUS = (
    MAPPED
    + """\
embeddings:
  class_path: flair.embeddings.OneHotEmbeddings.from_corpus
  init_args: {{min_freq: 1, embedding_length: 8}}
"""
)

CLASS_ARGUMENTS = """\
model:
  init_args:
    decoder:
      class_path: torch.nn.Linear
      init_args: {in_features: 32, out_features: 6, bias: false}
trainer:
  optimizer: torch.optim.SGD
  optimizer_kwargs: {momentum: 0.5, nesterov: true}
  plugins:
    - class_path: flair.trainers.plugins.LinearSchedulerPlugin
      init_args: {warmup_fraction: 0.2}
loggers:
  - class_path: lightning.fabric.loggers.CSVLogger
    init_args: {root_dir: "metrics: #1"}
"""


def _resolved(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as ended:
        checked_config([*argv, "--print_config"])
    assert ended.value.code in (0, None)
    return capsys.readouterr().out


def _column_files(folder: Path) -> Path:
    data = folder / "data"
    data.mkdir()
    for split in ("train", "dev", "test"):
        (data / f"{split}.txt").write_text(COLUMNS, encoding="utf-8")
    return data


def _configs(folder: Path) -> dict[str, list[str]]:
    data, cache, out = _column_files(folder), folder / "cache", folder / "out"
    files = {
        "checks": CONFIG,
        "awkward": AWKWARD_VALUES.format(data=data, cache=cache, out=out),
        "mapped": MAPPED.format(data=data, cache=cache, out=out),
        "class-arguments": CLASS_ARGUMENTS,
        "from-the-corpus": FROM_THE_CORPUS.format(data=data, cache=cache, out=out),
    }
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
    return {
        "trec example": [str(EXAMPLES / "trec.yaml")],
        "wnut16 example": [str(EXAMPLES / "wnut16.yaml")],
        "tests' config": [str(folder / "checks.yaml")],
        "awkward values": [str(folder / "awkward.yaml")],
        "mapped corpus": [str(folder / "mapped.yaml")],
        "class arguments": [str(EXAMPLES / "trec.yaml"), str(folder / "class-arguments.yaml")],
        "embeddings from the corpus": [str(folder / "from-the-corpus.yaml")],
        "overrides": [str(folder / "checks.yaml"), "--corpus.init_args.seed=7", "--trainer.learning_rate=1e-5"],
    }


def test_a_run_from_its_resolved_config_gets_the_same_arguments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for name, argv in _configs(tmp_path).items():
        _, _, given = checked_config(argv)
        resolved = tmp_path / f"{name}.resolved.yaml"
        resolved.write_text(_resolved(argv, capsys), encoding="utf-8")
        try:
            _, _, given_again = checked_config([str(resolved)])
        except ConfigError as refused:
            pytest.fail(f"{name}: its resolved config is refused: {refused}")
        first, again = what_the_run_receives(given), what_the_run_receives(given_again)
        for section, received in first.items():
            assert again[section] == received, f"{name}: {section} differs when run from its resolved config"


def test_awkward_strings_reach_the_classes_as_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = _configs(tmp_path)["awkward values"]
    _, _, given = checked_config(argv)
    corpus = given.corpus.init_args
    assert corpus.comment_symbol == "#: " and corpus.name == "" and corpus.column_delimiter == " "
    assert dict(corpus.label_name_map) == {"a: b": " leading space", "#x": "1e-5", "y": "null", "z": "~"}, (
        "quoted strings stay strings where the type takes no None"
    )
    assert given.model.init_args.rnn_type == " GRU" and given.trainer.learning_rate == 1e-5
    assert list(given.trainer.exclude_labels) == ["# ", "", ": "]
    printed = yaml.safe_load(_resolved(argv, capsys))
    assert printed["corpus"]["init_args"]["comment_symbol"] == "#: "
    assert printed["trainer"]["mini_batch_size"] is None, "it follows from global_batch_size, as in the run"


def test_flairs_comment_symbol_default_survives_config_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The trial's case: ``comment_symbol`` left to flair's ``"# "``; the saved config must read the same data from
    the same cache entry, never flair's ``# sent_id`` lines as tokens."""
    argv = _configs(tmp_path)["mapped corpus"]
    parser, _, given = checked_config(argv)
    resolved = tmp_path / "config.yaml"
    resolved.write_text(_resolved(argv, capsys), encoding="utf-8")
    assert yaml.safe_load(resolved.read_text())["corpus"]["init_args"]["comment_symbol"] == "# "
    parser_again, _, given_again = checked_config([str(resolved)])
    first = parser.instantiate_classes(given).corpus
    again = parser_again.instantiate_classes(given_again).corpus
    assert [token.text for token in again.train[0]] == ["The", "cat"], "comment lines are no tokens"
    assert [[t.text for t in s] for s in again.train] == [[t.text for t in s] for s in first.train]
    entries = [each for each in (tmp_path / "cache").iterdir() if not each.name.startswith((".", "locks"))]
    assert len(entries) == 1, f"one cache entry for the same run, found {sorted(e.name for e in entries)}"
