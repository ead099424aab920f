"""``save_adapters=True``: beside each model file, its LoRA adapters unmerged in peft's own folder
(``best-model.adapter/``), checked against peft and transformers alone: the pretrained transformer loaded with
``AutoModel``, the folder put on it with ``PeftModel.from_pretrained`` and merged gives the transformer weights of the
model file. Written once, from global rank 0, atomically; one folder per adapted embeddings; uploaded with a URL
base_path; never written once the model holds a model file's merged weights; refused on a model without adapters."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flair
import fsspec
import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings, TransformerWordEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.state.adapter_files import write_folder_atomically
from flair_fabric.state.run_store import RunStore

from ..storage_server import BUCKET, S3Server, start_server
from ..support import make_tiny_bert, no_training_may_start, small_trec, tiny_text_classifier
from .lora_support import LORA, lora_classifier

pytestmark = pytest.mark.multiprocess

TARGETS = ["query", "value"]
ARGUMENTS: dict[str, Any] = {  # no dev split: the best epoch is chosen by the train loss, so best-model.pt is written
    "optimizer": torch.optim.AdamW,
    "learning_rate": 5e-3,
    "global_batch_size": 8,
    "max_epochs": 2,
    "embeddings_storage_mode": "none",
    "accelerator": "cpu",
    "save_adapters": True,
}
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def _recording_writes(record: Path, save_pretrained: Any) -> Any:
    """peft's ``PeftModel.save_pretrained`` that first appends ``"<global rank> <run folder> <folder written>"`` to
    ``record`` (set before forking, it records on every rank)."""

    def recorded(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        target = Path(save_directory)
        with record.open("a") as stream:
            stream.write(f"{rank} {target.parent.name} {target.name}\n")
        return save_pretrained(self, save_directory, *args, **kwargs)

    return recorded


def _writes(record: Path, run: str) -> list[tuple[int, str]]:
    """(rank, folder) of each adapter folder written in ``run`` (a temporary ``.<folder>.<hex>.tmp`` counts as the
    folder it is renamed to)."""
    found = []
    for line in record.read_text().splitlines():
        rank, folder, name = line.split()
        if folder == run:
            found.append((int(rank), re.sub(r"^\.(.*)\.[0-9a-f]+\.tmp$", r"\1", name)))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny BERT classifier with LoRA on query and value trained with save_adapters=True in one process and on 2
    forked ranks (the same global batches), every adapter folder written recorded by rank; then the 2-rank run's
    model, handed back after its final test loaded best-model.pt's merged weights, trained again in one process."""
    out = tmp_path_factory.mktemp("adapter-files")
    corpus = small_trec(train_size=16, dev_size=0, test_size=4)
    bert = make_tiny_bert(out / "bert", corpus)
    record = out / "writes.txt"
    record.touch()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PeftModel, "save_pretrained", _recording_writes(record, PeftModel.save_pretrained))
        for run, extra in (("one", {}), ("two", {"devices": 2, "strategy": "ddp_fork"})):
            model = lora_classifier(corpus, bert, TARGETS)
            FabricTrainer(model, corpus).train(out / run, **ARGUMENTS, **extra)
        FabricTrainer(model, corpus).train(out / "again", **{**ARGUMENTS, "max_epochs": 1})
    return {"out": out, "bert": bert, "record": record}


def _transformer_of(model_file: Path, prefix: str = "embeddings.model.") -> dict[str, torch.Tensor]:
    """The transformer weights inside a flair model file (loaded by flair), under the transformer's own names."""
    state = TextClassifier.load(model_file).state_dict()
    return {name.removeprefix(prefix): tensor for name, tensor in state.items() if name.startswith(prefix)}


def _peft_merge(bert: Path, folder: Path) -> dict[str, torch.Tensor]:
    """The reference: the pretrained transformer (transformers alone), the folder's adapters on it (peft), merged."""
    from transformers import AutoModel

    adapted = PeftModel.from_pretrained(AutoModel.from_pretrained(str(bert)), str(folder))
    return {name: tensor.clone() for name, tensor in adapted.merge_and_unload().state_dict().items()}


def _equal_to_reference(in_file: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert in_file.keys() == reference.keys()
    for name, value in reference.items():  # flair adds a row to the word embeddings for its context marker
        torch.testing.assert_close(in_file[name][: len(value)], value, rtol=0, atol=0, msg=name)


def test_one_process_writes_peft_s_folder_of_the_unmerged_adapters_beside_each_model_file(runs: dict[str, Any]) -> None:
    run = runs["out"] / "one"
    for name in ("best-model", "final-model"):
        folder = run / f"{name}.adapter"
        assert (run / f"{name}.pt").is_file() and folder.is_dir(), name
        assert {path.name for path in folder.iterdir()} >= PEFT_FILES, name
        stored = load_file(folder / "adapter_model.safetensors")
        lora_b = [tensor for key, tensor in stored.items() if ".lora_B." in key]
        assert len(lora_b) == 4 and all(tensor.abs().max() > 0 for tensor in lora_b), "trained, not merged away"
        _equal_to_reference(_transformer_of(run / f"{name}.pt"), _peft_merge(runs["bert"], folder))
    config = json.loads((run / "final-model.adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(runs["bert"]) and sorted(config["target_modules"]) == TARGETS


def test_the_folders_hold_only_the_lora_weights_far_smaller_than_the_model_file(runs: dict[str, Any]) -> None:
    run = runs["out"] / "one"
    for name in ("best-model", "final-model"):
        folder = run / f"{name}.adapter"
        stored = load_file(folder / "adapter_model.safetensors")
        assert stored and all(re.search(r"\.lora_[AB]\.weight$", key) for key in stored), sorted(stored)
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        assert size * 5 < (run / f"{name}.pt").stat().st_size, (name, size)


def test_two_ranks_write_each_folder_once_from_global_rank_zero_as_one_process_does(runs: dict[str, Any]) -> None:
    one, two = _writes(runs["record"], "one"), _writes(runs["record"], "two")
    assert {folder for _, folder in one} == {"best-model.adapter", "final-model.adapter"}
    assert [rank for rank, _ in two] == [0] * len(two) and sorted(two) == sorted(one)
    for name in ("best-model.adapter", "final-model.adapter"):
        alone, together = runs["out"] / "one" / name, runs["out"] / "two" / name
        reference = load_file(alone / "adapter_model.safetensors")
        got = load_file(together / "adapter_model.safetensors")
        assert got.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
        config = json.loads((together / "adapter_config.json").read_text())
        assert config == json.loads((alone / "adapter_config.json").read_text())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"save_adapters=True: the TextClassifier has no transformer embeddings with peft adapters.*peft_config"),
        ("yes", r"save_adapters='yes' is not valid: pass True .* or False"),
    ],
    ids=["no-adapters", "not-a-bool"],
)
def test_save_adapters_without_adapters_or_not_a_bool_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any, message: str
) -> None:
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    no_training_may_start(monkeypatch)
    with pytest.raises(ValueError, match=message):
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(tmp_path / "run", max_epochs=1, save_adapters=value)
    assert not (tmp_path / "run" / "training.log").exists()


def test_several_adapted_embeddings_get_a_folder_each_named_by_their_path_in_the_model(tmp_path: Path) -> None:
    corpus = small_trec(train_size=8, dev_size=0, test_size=2)
    berts = [make_tiny_bert(tmp_path / f"bert-{seed}", corpus, seed=seed) for seed in (0, 1)]
    flair.set_seed(3)
    words = [
        TransformerWordEmbeddings(str(bert), fine_tune=True, peft_config=LoraConfig(target_modules=TARGETS, **LORA))
        for bert in berts
    ]
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = TextClassifier(DocumentPoolEmbeddings(words), label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    paths = [name for name, module in model.named_modules() if any(module is each for each in words)]
    assert paths == ["embeddings.embeddings.list_embedding_0", "embeddings.embeddings.list_embedding_1"]
    FabricTrainer(model, corpus).train(tmp_path / "run", **{**ARGUMENTS, "max_epochs": 1})
    folder = tmp_path / "run" / "final-model.adapter"
    assert sorted(path.name for path in folder.iterdir()) == paths
    for path, bert in zip(paths, berts, strict=True):
        assert {each.name for each in (folder / path).iterdir()} >= PEFT_FILES
        assert json.loads((folder / path / "adapter_config.json").read_text())["base_model_name_or_path"] == str(bert)
        in_file = _transformer_of(tmp_path / "run" / "final-model.pt", f"{path}.model.")
        _equal_to_reference(in_file, _peft_merge(bert, folder / path))


class _ReloadsItsModelFile(TrainerPlugin):
    """After the first epoch: writes ``mine.pt`` (noting whether ``mine.adapter/`` came with it), loads the file's
    merged weights back into the model, and writes ``mine.pt`` again."""

    def __init__(self, base_path: Path) -> None:
        super().__init__()
        self.base_path = base_path
        self.written_first: list[bool] = []

    @TrainerPlugin.hook
    def after_training_epoch(self, epoch: int, **kw: Any) -> None:
        self.trainer.save_model(self.base_path / "mine.pt")
        self.written_first.append((self.base_path / "mine.adapter" / "adapter_model.safetensors").is_file())
        self.trainer.load_model(self.base_path / "mine.pt")
        self.trainer.save_model(self.base_path / "mine.pt")


def test_once_a_model_file_s_merged_weights_are_loaded_no_folder_is_written_and_the_earlier_is_removed(
    tmp_path: Path,
) -> None:
    corpus = small_trec(train_size=8, dev_size=0, test_size=2)
    model = lora_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus), TARGETS)
    plugin = _ReloadsItsModelFile(tmp_path / "run")
    FabricTrainer(model, corpus).train(tmp_path / "run", plugins=[plugin], **{**ARGUMENTS, "max_epochs": 1})
    run = tmp_path / "run"
    assert plugin.written_first == [True], "a model file a plugin writes gets its folder too"
    assert (run / "mine.pt").is_file() and (run / "final-model.pt").is_file()
    assert not (run / "mine.adapter").exists() and not (run / "final-model.adapter").exists()
    assert [path.name for path in run.iterdir() if path.name.startswith(".")] == [], "no temporary folder left"
    log = (run / "training.log").read_text()
    assert "save_adapters: mine.adapter is not written (and an earlier one is removed)" in log
    assert "save_adapters: final-model.adapter is not written" in log


def test_a_model_handed_back_holding_a_model_file_s_merged_weights_writes_no_folder_in_a_later_run(
    runs: dict[str, Any],
) -> None:
    again = runs["out"] / "again"
    assert (again / "final-model.pt").is_file() and (again / "best-model.pt").is_file()
    assert sorted(path.name for path in again.glob("*.adapter")) == []
    assert "save_adapters: final-model.adapter is not written" in (again / "training.log").read_text()


def test_a_fresh_run_removes_an_earlier_run_s_best_model_folders_with_its_best_model_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "best-model.adapter").mkdir(parents=True)
    (run / "best-model.adapter" / "adapter_config.json").write_text("{}")
    (run / "best-model.pt").write_bytes(b"an earlier run's")
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    try:
        FabricTrainer(tiny_text_classifier(corpus), corpus).train(run, max_epochs=1, use_final_model_for_eval=True)
    except IsADirectoryError as error:  # flair's own removal of the earlier best-model* files met the folder
        pytest.fail(f"the earlier run's folder was left to flair's removal of files: {error}")
    assert not (run / "best-model.adapter").exists() and not (run / "best-model.pt").exists()
    assert (run / "final-model.pt").is_file()


def test_a_folder_is_replaced_whole_a_failed_write_leaves_the_previous_one(tmp_path: Path) -> None:
    folder = tmp_path / "best-model.adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("previous")

    def fails_half_way(temporary: Path) -> None:
        (temporary / "adapter_config.json").write_text("next")
        assert (folder / "adapter_config.json").read_text() == "previous", "written in place"
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space left"):
        write_folder_atomically(folder, fails_half_way)
    assert [path.name for path in tmp_path.iterdir()] == ["best-model.adapter"]
    assert (folder / "adapter_config.json").read_text() == "previous"
    write_folder_atomically(folder, lambda temporary: (temporary / "adapter_config.json").write_text("next"))
    assert [path.name for path in tmp_path.iterdir()] == ["best-model.adapter"]
    assert (folder / "adapter_config.json").read_text() == "next"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on loopback (as the storage tests' own)."""
    running = start_server()
    yield running
    running.server.stop()


def test_with_a_url_base_path_the_folders_reach_the_bucket(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("FLAIR_FABRIC_STAGING", str(tmp_path / "staging"))
    s3fs.S3FileSystem.clear_instance_cache()
    corpus = small_trec(train_size=8, dev_size=0, test_size=2)
    model = lora_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus), TARGETS)
    url = f"s3://{BUCKET}/adapters-{uuid.uuid4().hex[:8]}"
    FabricTrainer(model, corpus).train(url, **{**ARGUMENTS, "max_epochs": 1})
    staged = RunStore.of(url).local
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    for name in ("best-model.adapter", "final-model.adapter"):
        files = {path.name: path.read_bytes() for path in (staged / name).iterdir()}
        assert set(files) >= PEFT_FILES, name
        in_bucket = {str(path).rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.find(f"{url}/{name}")}
        assert in_bucket == files, name
