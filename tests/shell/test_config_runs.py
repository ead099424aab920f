"""``python -m flair_fabric train``: the example configs train; a config run is the equivalent Python script's run
(one process, two ranks started by the command's own relaunch, two ranks started by torchrun); the resolved config
goes to ``config.yaml`` and to the tracker as its hyperparameters; a resume continues only the same config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
import yaml
from flair.data import Sentence
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import SequenceTagger, TextClassifier
from flair.trainers.plugins import LinearSchedulerPlugin

from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC, TREC_LABEL_TYPE, WNUT16
from flair_fabric.shell.command import checked_config, train
from flair_fabric.shell.components import make_components
from flair_fabric.shell.errors import ConfigError
from flair_fabric.shell.record import flattened

from ..support import REPO, loss_file_column, make_tiny_bert, run_command
from .arguments import what_the_run_receives

pytestmark = pytest.mark.multiprocess
EXAMPLES = REPO / "examples" / "configs"
SIZES = {"train_size": 24, "dev_size": 8, "test_size": 8}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("bert"), TREC(**SIZES))


def _small(config: str, bert: Path, base_path: Path, *more: str) -> list[str]:
    """An example config made tiny by overrides: the tiny BERT, a few sentences, one CPU process, no CSV logger."""
    sizes = [f"--corpus.init_args.{name}={value}" for name, value in SIZES.items()]
    return [
        str(EXAMPLES / config),
        *sizes,
        f"--embeddings.init_args.model={bert}",
        f"--trainer.base_path={base_path}",
        "--trainer.devices=1",
        "--loggers=[]",
        *more,
    ]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final-model.pt", map_location="cpu", weights_only=False)["state_dict"]


def _script(bert: Path, base_path: Path) -> None:
    """What examples/configs/trec.yaml (made tiny, 2 epochs, global batch 8) says, written as a script."""
    flair.set_seed(42)
    corpus = TREC(**SIZES)
    embeddings = TransformerDocumentEmbeddings(str(bert), fine_tune=True)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    FabricTrainer(model, corpus).fine_tune(
        base_path,
        learning_rate=1e-4,
        global_batch_size=8,
        max_epochs=2,
        group_by_length=True,
        accelerator="cpu",
        devices=1,
    )


@pytest.fixture(scope="module")
def runs(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script; the config in this process; the config on 2 ranks with an MLflow tracker from a second file."""
    out = tmp_path_factory.mktemp("config_runs")
    _script(tiny_bert, out / "script")
    common = ["--trainer.global_batch_size=8", "--trainer.max_epochs=2"]
    train(_small("trec.yaml", tiny_bert, out / "config", *common))
    tracker = out / "tracker.yaml"
    uri = f"file:{out / 'mlruns'}"
    tracker.write_text(
        yaml.safe_dump({"loggers": [{"class_path": "flair_fabric.MLflowTracker", "init_args": {"tracking_uri": uri}}]})
    )
    argv = _small("trec.yaml", tiny_bert, out / "ranks", *common, "--trainer.devices=2")
    argv.remove("--loggers=[]")
    argv.insert(1, str(tracker))  # composed: the second file's loggers replace the first's
    run_command(
        [sys.executable, "-m", "flair_fabric", "train", *argv],
        "python -m flair_fabric train",
        extra_env={"MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", "-m"]
    argv = _small("trec.yaml", tiny_bert, out / "torchrun", *common, "--trainer.devices=2")
    run_command([*torchrun, "flair_fabric", "train", *argv], "torchrun -m flair_fabric train")
    return out


def test_a_config_run_trains_the_weights_of_the_equivalent_script(runs: Path) -> None:
    script = _weights(runs / "script")
    in_process = _weights(runs / "config")
    assert script.keys() == in_process.keys()
    for name, value in script.items():
        assert torch.equal(value, in_process[name]), name
    for started in ("ranks", "torchrun"):  # the command's own relaunch, and torchrun running it on every rank
        two_ranks = _weights(runs / started)
        for name, value in script.items():
            torch.testing.assert_close(two_ranks[name], value, rtol=0, atol=1e-5, msg=f"{started}: {name}")


def test_a_run_from_the_config_yaml_a_run_wrote_is_the_same_run(runs: Path, tiny_bert: Path, tmp_path: Path) -> None:
    common = ["--trainer.global_batch_size=8", "--trainer.max_epochs=2"]
    _, _, given = checked_config(_small("trec.yaml", tiny_bert, runs / "config", *common))
    written = runs / "config" / "config.yaml"
    try:
        _, _, given_again = checked_config([str(written)])
    except ConfigError as refused:
        pytest.fail(f"the config.yaml a run wrote is refused: {refused}")
    assert what_the_run_receives(given_again) == what_the_run_receives(given)
    again = tmp_path / "again"
    try:
        train([str(written), f"--trainer.base_path={again}"])
    except ValueError as refused:
        pytest.fail(f"the config.yaml a run wrote does not train: {refused}")
    first, second = _weights(runs / "config"), _weights(again)
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name}: the run from config.yaml trained other weights"


def test_the_two_rank_config_run_writes_its_config_once_and_one_tracker_run_with_it(
    runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store (kept for tests: no database)

    written = flattened(yaml.safe_load((runs / "ranks" / "config.yaml").read_text()))
    assert written.get("trainer.devices") == 2 and written.get("trainer.global_batch_size") == 8, "the overrides"
    assert written.get("corpus.init_args.train_size") == 24 and written.get("trainer.method") == "fine_tune"
    assert written.get("trainer.eval_batch_size") == 16, "every key, fine_tune's defaults included"
    assert not list((runs / "ranks").glob(".config.yaml.*")), "written whole, by one process"
    client = MlflowClient(tracking_uri=f"file:{runs / 'mlruns'}")
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(found) == 1, "one tracker run for the job, none per rank"
    params = found[0].data.params
    assert params.get("trainer.learning_rate") == "0.0001" and params.get("trainer.devices") == "2"
    assert params.get("model.class_path") == "flair.models.TextClassifier", "the resolved config is the hyperparameters"
    losses = client.get_metric_history(found[0].info.run_id, "train/loss")
    assert [metric.step for metric in losses] == [3, 6], "each epoch's loss at its last step (24 questions / 8)"
    expected = loss_file_column(runs / "ranks", "TRAIN_LOSS")
    assert [metric.value for metric in losses] == pytest.approx(expected, abs=1e-4)


def test_the_ner_example_trains_a_tagger_with_the_corpus_tag_dictionary(tiny_bert: Path, tmp_path: Path) -> None:
    # 24 tweets miss entity types of the dev split: the dictionary collects the dev and test labels too
    more = ["--trainer.max_epochs=1", "--trainer.global_batch_size=8", "--dictionary.add_dev_test=true"]
    train(_small("wnut16.yaml", tiny_bert, tmp_path, *more))
    tagger = SequenceTagger.load(tmp_path / "final-model.pt")
    reference = WNUT16(**SIZES).make_label_dictionary("ner", add_unk=False, add_dev_test=True)
    spans = {item.split("-", 1)[-1] for item in tagger.label_dictionary.get_items() if item != "O"}
    assert spans == set(reference.get_items()) and tagger.tag_type == "ner"
    assert "<unk>" not in tagger.label_dictionary.get_items(), "dictionary.add_unk: false"
    assert len(loss_file_column(tmp_path, "TRAIN_LOSS")) == 1


def test_a_resume_continues_the_same_config_and_refuses_a_changed_one(tiny_bert: Path, tmp_path: Path) -> None:
    once = ["--trainer.max_epochs=1", "--trainer.checkpoint_every_n_epochs=1", "--trainer.global_batch_size=8"]
    train(_small("trec.yaml", tiny_bert, tmp_path, *once))
    changed = [*once, "--trainer.resume_from=auto", "--trainer.learning_rate=0.5"]
    with pytest.raises(ConfigError) as refused:
        train(_small("trec.yaml", tiny_bert, tmp_path, *changed))
    assert "trainer.learning_rate (0.0001 -> 0.5)" in str(refused.value)
    more: Any = [*once, "--trainer.resume_from=auto"]
    more[0] = "--trainer.max_epochs=2"
    try:
        train(_small("trec.yaml", tiny_bert, tmp_path, *more))
    except ConfigError as refused:
        pytest.fail(f"a resume with more epochs was refused: {refused}")
    assert len(loss_file_column(tmp_path, "TRAIN_LOSS")) == 2, "the resumed run added its second epoch"
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_epochs"] == 2


def test_the_trainers_and_the_models_class_arguments_are_made_from_import_paths_and_specs(
    tiny_bert: Path, tmp_path: Path
) -> None:
    more = tmp_path / "more.yaml"
    more.write_text(
        "model:\n  init_args:\n    decoder:\n      class_path: torch.nn.Linear\n"
        "      init_args: {in_features: 32, out_features: 6, bias: false}\n"
        "trainer:\n  optimizer: torch.optim.SGD\n  optimizer_kwargs: {momentum: 0.5}\n  plugins:\n"
        "    - class_path: flair.trainers.plugins.LinearSchedulerPlugin\n      init_args: {warmup_fraction: 0.2}\n"
    )
    argv = _small("trec.yaml", tiny_bert, tmp_path / "out")
    argv.insert(1, str(more))
    parser, config, given = checked_config(argv)
    made = make_components(parser, config, given)
    decoder = made.model.decoder
    assert isinstance(decoder, torch.nn.Linear) and decoder.out_features == 6 and decoder.bias is None
    assert made.trainer_arguments["optimizer"] is torch.optim.SGD and made.trainer_arguments.get("momentum") == 0.5
    (plugin,) = made.trainer_arguments["plugins"]
    assert isinstance(plugin, LinearSchedulerPlugin) and plugin.warmup_fraction == 0.2
    assert "learning_rate" in made.trainer_arguments and "eval_batch_size" not in made.trainer_arguments, (
        "the trainer gets the keys the config gives, so that flair's defaults apply"
    )


ONE_HOT = """\
seed: 5
corpus:
  class_path: flair_fabric.datasets.WNUT16
  init_args: {train_size: 24, dev_size: 8, test_size: 8}
embeddings:
  class_path: flair.embeddings.OneHotEmbeddings.from_corpus
  init_args: {min_freq: 1, embedding_length: 16}
model:
  class_path: flair.models.SequenceTagger
  init_args: {tag_type: ner, hidden_size: 8, use_crf: false}
dictionary: {add_dev_test: true}
trainer: {base_path: BASE, max_epochs: 2, mini_batch_size: 8, accelerator: cpu, devices: 1}
"""

LOAD_WITH_FLAIR_ALONE = """
import sys
from flair.data import Sentence
from flair.models import SequenceTagger
tagger = SequenceTagger.load(sys.argv[1])
sentences = [Sentence(line) for line in sys.argv[2:]]
tagger.predict(sentences)
print(type(tagger.embeddings).__name__, len(tagger.embeddings.vocab_dictionary))
print([[token.get_label("ner").value for token in sentence] for sentence in sentences])
print("flair_fabric" in sys.modules)
"""


def test_embeddings_made_from_the_corpus_train_as_the_script_and_load_in_flair_alone(tmp_path: Path) -> None:
    from flair.embeddings import OneHotEmbeddings

    config = tmp_path / "one_hot.yaml"
    config.write_text(ONE_HOT.replace("BASE", str(tmp_path / "config")), encoding="utf-8")
    train([str(config)])
    flair.set_seed(5)
    corpus = WNUT16(train_size=24, dev_size=8, test_size=8)
    embeddings = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=16)
    labels = corpus.make_label_dictionary("ner", add_unk=False, add_dev_test=True)
    model = SequenceTagger(embeddings, labels, "ner", hidden_size=8, use_crf=False)
    FabricTrainer(model, corpus).train(tmp_path / "script", max_epochs=2, mini_batch_size=8, accelerator="cpu")
    script, from_config = _weights(tmp_path / "script"), _weights(tmp_path / "config")
    assert script.keys() == from_config.keys()
    for name, value in script.items():
        assert torch.equal(value, from_config[name]), f"{name}: the config's one-hot embeddings are not the script's"
    texts = [sentence.to_plain_string() for sentence in corpus.test][:3]
    loaded = SequenceTagger.load(tmp_path / "script" / "final-model.pt")
    expected = [Sentence(text) for text in texts]
    loaded.predict(expected)
    code = [sys.executable, "-c", LOAD_WITH_FLAIR_ALONE, str(tmp_path / "config" / "final-model.pt"), *texts]
    printed = run_command(code, "flair's SequenceTagger.load").strip().splitlines()[-3:]
    assert printed[0] == f"OneHotEmbeddings {len(embeddings.vocab_dictionary)}"
    assert printed[1] == str([[token.get_label("ner").value for token in sentence] for sentence in expected])
    assert printed[2] == "False", "loaded by flair alone"
