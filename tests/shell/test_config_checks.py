"""``python -m flair_fabric train``: the config's checks, before any process starts or any data is read; the help,
overrides, composition, ``--print_config``, the dictionary rule and the resume rule. Nothing here trains."""

from __future__ import annotations

import enum
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flair_fabric import FabricTrainer
from flair_fabric.shell.command import checked_config, train
from flair_fabric.shell.errors import ConfigError
from flair_fabric.shell.record import check_resume, flattened

from ..support import REPO

CONFIG = """\
seed: 3
corpus:
  class_path: tests.shell.counting.CountingCorpus
  init_args:
    train_size: 24
    dev_size: 8
    test_size: 8
model:
  class_path: flair.models.TextClassifier
  init_args:
    label_type: question_class
embeddings:
  class_path: flair.embeddings.TransformerDocumentEmbeddings
  init_args:
    model: unused-here
trainer:
  method: fine_tune
  base_path: out
  max_epochs: 2
  mini_batch_size: 4
"""


def _write(folder: Path, text: str, name: str = "run.yaml") -> Path:
    file = folder / name
    file.write_text(text, encoding="utf-8")
    return file


def _refusal(argv: list[str]) -> str:
    from tests.shell.counting import CountingCorpus

    made = CountingCorpus.made
    with pytest.raises(ConfigError) as refused:
        checked_config(argv)
    assert CountingCorpus.made == made, "refused before any data is read"
    return str(refused.value)


def _line_of(file: Path, text: str) -> int:
    return next(number for number, line in enumerate(file.read_text().splitlines(), 1) if text in line)


def test_overrides_and_later_files_win_and_the_trainer_gets_flairs_defaults_for_its_method(tmp_path: Path) -> None:
    first = _write(tmp_path, CONFIG)
    second = _write(tmp_path, "trainer:\n  learning_rate: 0.25\n  max_epochs: 5\n", "more.yaml")
    _, config, given = checked_config([str(first), str(second), "--trainer.max_epochs", "7"])
    assert config.trainer.learning_rate == 0.25 and config.trainer.max_epochs == 7
    assert config.trainer.mini_batch_size == 4, "a later file changes only the keys it gives"
    assert config.corpus.init_args.train_size == 24
    fine_tune = inspect.signature(FabricTrainer.fine_tune).parameters  # the independent reference: the signature
    assert config.trainer.eval_batch_size == fine_tune["eval_batch_size"].default
    assert config.trainer.use_final_model_for_eval is fine_tune["use_final_model_for_eval"].default
    assert config.trainer.optimizer is fine_tune["optimizer"].default
    assert dict(given.trainer).keys() == {"method", "base_path", "max_epochs", "mini_batch_size", "learning_rate"}
    _, config, _ = checked_config([str(first), "--corpus.init_args.train_size", "12", "--trainer.method", "train"])
    assert config.corpus.init_args.train_size == 12
    assert config.trainer.learning_rate == inspect.signature(FabricTrainer.train).parameters["learning_rate"].default


def test_help_lists_every_key_of_the_trainers_signature_without_importing_torch_or_flair() -> None:
    code = (
        "import sys\nfrom flair_fabric.cli import main\ntry:\n    main(['train', '--trainer.method', 'fine_tune',"
        " '--help'])\nexcept SystemExit:\n    pass\nprint('IMPORTED', 'torch' in sys.modules, 'flair' in sys.modules)"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    ).stdout
    assert "IMPORTED False False" in output
    text = " ".join(output.split())
    for name, parameter in inspect.signature(FabricTrainer.fine_tune).parameters.items():
        if name == "self" or parameter.kind == parameter.VAR_KEYWORD:
            continue
        assert f"--trainer.{name} " in text, name
        default = parameter.default
        if isinstance(default, bool | int | float) and name != "base_path":
            shown = default.name if isinstance(default, enum.Enum) else default
            assert f"default: {shown})" in text.split(f"--trainer.{name} ", 2)[-1].split("--trainer.")[0], name
    for key in ("--corpus ", "--embeddings ", "--model ", "--loggers ", "--dictionary.add_unk", "--seed "):
        assert key in text


@pytest.mark.parametrize(
    ("change", "key", "says"),
    [
        (("max_epochs: 2", "max_epoch: 2"), "trainer.max_epoch", "did you mean 'trainer.max_epochs'"),
        (("model:", "modle:"), "modle", "did you mean 'model'"),
        (("max_epochs: 2", "max_epochs: two"), "trainer.max_epochs", "int"),
        (("flair.models.TextClassifier", "flair.models.TextClassifer"), "model.class_path", "TextClassifer"),
        (("model: unused-here", "modell: unused-here"), "embeddings.init_args.modell", "did you mean 'model'"),
        (("label_type: question_class", "label_typ: question_class"), "model.init_args.label_typ", "'label_type'"),
        (("train_size: 24", "train_size: many"), "corpus.init_args.train_size", "int"),
    ],
)
def test_a_wrong_key_or_value_is_refused_naming_the_key_and_its_file_line(
    tmp_path: Path, change: tuple[str, str], key: str, says: str
) -> None:
    file = _write(tmp_path, CONFIG.replace(*change))
    message = _refusal([str(file)])
    assert f"{file}:{_line_of(file, change[1])}: {key}:" in message and says in message


def test_an_unknown_override_suggests_the_closest_key_and_a_yaml_mistake_names_its_line(tmp_path: Path) -> None:
    file = _write(tmp_path, CONFIG)
    message = _refusal([str(file), "--trainer.learnig_rate", "0.1"])
    assert "command line: trainer.learnig_rate: unknown key; did you mean 'trainer.learning_rate'?" in message
    for override in ("--model.init_args.label_typ", "--model.label_typ"):  # jsonargparse's short spelling too
        message = _refusal([str(file), override, "x"])
        assert message == (
            "command line: model.init_args.label_typ: unknown argument of flair.models.TextClassifier;"
            " did you mean 'label_type'?"
        )
    message = _refusal([str(file), "--model.init_args.multi_label", "often"])
    assert message.startswith("command line: model.init_args.multi_label:") and "NestedArg" not in message
    assert "multi_label='often'" in message, "the override as it was given"
    broken = _write(tmp_path, CONFIG.replace("max_epochs: 2", "max_epochs: [2"), "broken.yaml")
    message = _refusal([str(broken)])
    assert message.startswith(f"{broken}:{_line_of(broken, 'max_epochs: [2')}: YAML syntax error")


def test_a_missing_data_folder_is_refused_before_flair_is_imported(tmp_path: Path) -> None:
    text = CONFIG.replace("tests.shell.counting.CountingCorpus", "flair.datasets.ColumnCorpus")
    text = text.replace("train_size: 24", f"data_folder: {tmp_path / 'nowhere'}")
    file = _write(tmp_path, text)
    code = (
        "import sys\nfrom flair_fabric.cli import main\ncode = main(['train', sys.argv[1]])\n"
        "print('IMPORTED', code, 'flair' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(file)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "IMPORTED 2 False" in done.stdout
    assert f"{file}:{_line_of(file, 'data_folder')}: corpus.init_args.data_folder:" in done.stderr
    assert "no such folder" in done.stderr


def test_an_mlflow_file_store_mlflow_will_refuse_is_refused_before_any_data_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    loggers = "loggers:\n  - class_path: flair_fabric.MLflowTracker\n    init_args: {tracking_uri: TRACKING}\n"
    lightnings = loggers.replace("flair_fabric.MLflowTracker", "lightning.pytorch.loggers.MLFlowLogger")
    for uri, listed in ((f"file:{tmp_path / 'mlruns'}", loggers), (str(tmp_path / "mlruns"), lightnings)):
        file = _write(tmp_path, CONFIG + listed.replace("TRACKING", uri))
        message = _refusal([str(file)])
        assert message.startswith(f"{file}:{_line_of(file, 'loggers:')}: loggers[0].init_args.tracking_uri:")
        assert "MLFLOW_ALLOW_FILE_STORE=true" in message
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _passes([str(file)])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    _passes([str(_write(tmp_path, CONFIG + loggers.replace("TRACKING", "http://127.0.0.1:5999")))])


def test_print_config_prints_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    file = _write(tmp_path, CONFIG)
    with pytest.raises(SystemExit) as ended:
        checked_config([str(file), "--trainer.max_epochs", "9", "--print_config"])
    assert ended.value.code in (0, None)
    printed = flattened(yaml.safe_load(capsys.readouterr().out))
    assert printed.get("trainer.max_epochs") == 9, "the override"
    assert printed.get("trainer.learning_rate") == 5e-05 and printed.get("trainer.eval_batch_size") == 16, "defaults"
    assert printed.get("corpus.init_args.dev_size") == 8
    assert printed.get("model.class_path") == "flair.models.TextClassifier"


def _resolved(**trainer: Any) -> str:
    config = {"corpus": {"class_path": "x"}, "trainer": {"base_path": "out", "learning_rate": 0.1, **trainer}}
    return yaml.safe_dump(config)


def test_a_resume_may_change_the_epochs_and_devices_but_not_the_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(_resolved(max_epochs=2, devices=2, resume_from=None))
    try:
        check_resume(tmp_path, _resolved(max_epochs=5, devices=1, resume_from="auto"))
    except ConfigError as refused:
        pytest.fail(f"a resume with more epochs on fewer devices was refused: {refused}")
    with pytest.raises(ConfigError) as refused:
        check_resume(tmp_path, _resolved(max_epochs=5, devices=2, resume_from="auto", learning_rate=0.2))
    assert "trainer.learning_rate (0.1 -> 0.2)" in str(refused.value) and "max_epochs (" not in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        check_resume(tmp_path, _resolved(max_epochs=2, devices=2, resume_from="auto", mini_batch_size=8))
    assert "trainer.mini_batch_size (<absent> -> 8)" in str(refused.value)


@pytest.mark.parametrize(
    ("override", "changed"),
    [
        ("--seed=4", "seed (3 -> 4)"),
        ("--corpus.init_args.train_size=12", "corpus.init_args.train_size (24 -> 12)"),
        ("--model.init_args.label_type=other", "model.init_args.label_type ('question_class' -> 'other')"),
        (("tests.shell.counting.CountingCorpus", "flair_fabric.datasets.TREC"), "corpus.class_path ('tests.shell"),
        ("--embeddings.init_args.model=other", "embeddings.init_args.model ('unused-here' -> 'other')"),
        ("--dictionary.add_unk=true", "dictionary.add_unk (False -> True)"),
        ("--loggers=[{class_path: lightning.fabric.loggers.CSVLogger, init_args: {root_dir: m}}]", "loggers ([] -> "),
    ],
)
def test_a_resume_refuses_a_change_in_any_section(
    tmp_path: Path, capsys: pytest.CaptureFixture, override: str | tuple[str, str], changed: str
) -> None:
    """Not only the trainer's keys: another corpus, model, embeddings, dictionary, seed or loggers is another run."""
    file = _write(tmp_path, CONFIG)
    if isinstance(override, tuple):
        runs = [[str(file)], [str(_write(tmp_path, CONFIG.replace(*override), "other.yaml"))]]
    else:
        runs = [[str(file)], [str(file), override]]
    for argv, name in zip(runs, ("config.yaml", "changed.yaml"), strict=True):
        with pytest.raises(SystemExit):
            checked_config([*argv, "--print_config"])
        (tmp_path / name).write_text(capsys.readouterr().out)
    with pytest.raises(ConfigError) as refused:
        check_resume(tmp_path, (tmp_path / "changed.yaml").read_text())
    assert changed in str(refused.value)


def _passes(argv: list[str]) -> Any:
    try:
        return checked_config(argv)
    except ConfigError as refused:
        pytest.fail(f"a valid config was refused: {refused}")


def test_the_readmes_config_and_the_examples_pass_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the README says, for its tracker's default folder
    readme = (REPO / "README.md").read_text().split("## From the shell", 1)[1]
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    _, config, _ = _passes([str(_write(tmp_path, block))])
    assert config.trainer.global_batch_size == 32 and config.loggers[0].class_path == "flair_fabric.MLflowTracker"
    for example in sorted((REPO / "examples" / "configs").glob("*.yaml")):
        _, config, _ = _passes([str(example)])
        assert config.trainer.method == "fine_tune" and config.trainer.devices == 2, example.name


def test_a_later_file_replaces_a_list_whole(tmp_path: Path) -> None:
    csv = "loggers:\n  - class_path: lightning.fabric.loggers.CSVLogger\n    init_args: {root_dir: a}\n"
    tensorboard = "loggers:\n  - class_path: lightning.fabric.loggers.TensorBoardLogger\n    init_args: {root_dir: b}\n"
    files = [_write(tmp_path, CONFIG + csv), _write(tmp_path, tensorboard, "more.yaml")]
    _, config, _ = checked_config([str(file) for file in files])
    assert [logger.class_path for logger in config.loggers] == ["lightning.fabric.loggers.TensorBoardLogger"]


def test_a_config_corpus_may_be_a_mapped_corpus_made_from_column_files(tmp_path: Path) -> None:
    from flair_fabric.data import MappedCorpus
    from flair_fabric.datasets import WNUT16

    WNUT16(train_size=12, dev_size=4, test_size=4, split_files_to=tmp_path / "ner")
    text = f"""\
corpus:
  class_path: flair_fabric.data.MappedCorpus.from_column_files
  init_args:
    data_folder: {tmp_path / "ner"}
    column_format: {{0: text, 1: ner}}
    column_delimiter: "\\t"
    cache_folder: {tmp_path / "cache"}
model:
  class_path: flair.models.SequenceTagger
  init_args: {{tag_type: ner}}
trainer:
  base_path: out
"""
    parser, _, given = _passes([str(_write(tmp_path, text))])
    made = parser.instantiate_classes(given).corpus
    assert isinstance(made, MappedCorpus) and len(made.train) == 12 and len(made.dev) == 4


def test_a_sections_help_lists_the_arguments_of_the_class_it_names(capsys: pytest.CaptureFixture) -> None:
    try:
        with pytest.raises(SystemExit) as ended:
            checked_config(["--model.help", "flair.models.SequenceTagger"])
    except ConfigError as refused:
        pytest.fail(f"--model.help was refused: {refused}")
    assert ended.value.code in (0, None)
    shown = capsys.readouterr().out
    assert "--model.tag_type" in shown and "--model.hidden_size" in shown and "(type: int, default: 256)" in shown


def test_a_torchrun_restart_with_a_changed_config_is_refused_before_any_data_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted torchrun job resumes by itself (resume_from 'auto'): it too must be the run's config."""
    from tests.shell.counting import DataWasRead

    base = tmp_path / "out"
    file = _write(tmp_path, CONFIG.replace("base_path: out", f"base_path: {base}"))
    parser, config, _ = checked_config([str(file)])
    started = yaml.safe_load(parser.dump(config, skip_none=False))
    started["trainer"]["learning_rate"] = 0.5
    base.mkdir()
    (base / "config.yaml").write_text(yaml.safe_dump(started))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")

    def went_past_the_checks(*args: Any) -> None:
        raise DataWasRead("the corpus and the model were about to be made")

    monkeypatch.setattr("flair_fabric.shell.components.make_components", went_past_the_checks)
    with pytest.raises((ConfigError, DataWasRead)) as refused:
        train([str(file)])
    assert isinstance(refused.value, ConfigError), f"the restarted job went on: {refused.value}"
    assert "trainer.learning_rate (0.5 -> 5e-05)" in str(refused.value)


def test_a_function_that_takes_the_corpus_gets_the_made_corpus(tmp_path: Path) -> None:
    from flair.embeddings import CharacterEmbeddings

    from flair_fabric.shell.components import make_components

    transformer = "  class_path: flair.embeddings.TransformerDocumentEmbeddings\n  init_args:\n    model: unused-here\n"
    characters = "  class_path: tests.shell.counting.character_embeddings\n  init_args: {hidden_size_char: 6}\n"
    parser, config, given = _passes([str(_write(tmp_path, CONFIG.replace(transformer, characters)))])
    assert "corpus" not in given.embeddings.init_args, "the corpus is not the config's to give"
    made = make_components(parser, config, given)
    characters = {character for sentence in made.corpus.train for token in sentence for character in token.text}
    assert isinstance(made.model.embeddings, CharacterEmbeddings)
    assert set(made.model.embeddings.char_dictionary.get_items()) == characters | {"<unk>"}


def test_the_label_dictionary_follows_the_dictionary_sections_knobs(tmp_path: Path) -> None:
    """``dictionary.label_type`` (else the model's ``tag_type``), ``min_count``, ``add_unk``, ``add_dev_test``: each
    changes the dictionary here (a tag seen once, a tag only in dev), compared with flair's own
    ``make_label_dictionary``."""
    from flair.datasets import ColumnCorpus
    from flair.models import SequenceTagger
    from jsonargparse import Namespace

    from flair_fabric.shell.components import label_dictionary

    rows = {
        "train": "The DT DET\ncat NN NOUN\nsat VBD VERB\n\nA DT DET\ndog NN NOUN\nbarked VBD VERB\n\nOh UH INTJ\n\n",
        "dev": "Run VB AUX\n\n",
        "test": "The DT DET\n\n",
    }
    for split, text in rows.items():
        (tmp_path / f"{split}.txt").write_text(text, encoding="utf-8")
    corpus = ColumnCorpus(tmp_path, {0: "text", 1: "pos", 2: "upos"})
    cases = [
        ({"label_type": None, "min_count": -1, "add_unk": False, "add_dev_test": False}, "pos"),
        ({"label_type": "upos", "min_count": -1, "add_unk": False, "add_dev_test": False}, "upos"),
        ({"label_type": None, "min_count": 2, "add_unk": False, "add_dev_test": False}, "pos"),
        ({"label_type": None, "min_count": -1, "add_unk": True, "add_dev_test": False}, "pos"),
        ({"label_type": "upos", "min_count": -1, "add_unk": False, "add_dev_test": True}, "upos"),
    ]
    seen = []
    for knobs, label_type in cases:
        made = label_dictionary(corpus, Namespace(**knobs), SequenceTagger, {"tag_type": "pos"})
        expected = corpus.make_label_dictionary(
            label_type, min_count=knobs["min_count"], add_unk=knobs["add_unk"], add_dev_test=knobs["add_dev_test"]
        )
        assert made.get_items() == expected.get_items(), knobs
        seen.append(tuple(made.get_items()))
    assert len(set(seen)) == len(seen), "each knob changes the dictionary with this data"
