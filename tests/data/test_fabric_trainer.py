"""FabricTrainer on a memory-mapped corpus: 2 ranks train to the weights they reach on flair's corpus in memory, with
each start method, shuffled and balanced by length; the lengths for balancing come from storage, not from built
data points."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import flair
import nbformat
import pytest
import torch
from flair.datasets import ColumnCorpus
from nbclient import NotebookClient
from torch.utils.data import ConcatDataset, Subset

from flair_fabric import FabricTrainer
from flair_fabric.data import MappedCorpus, MappedSplit, stored_lengths
from flair_fabric.datasets import WNUT16_LABEL_TYPE
from flair_fabric.launch import transport
from flair_fabric.training.balancing import data_point_length
from flair_fabric.training.lengths import data_point_lengths

from ..support import (
    REPO,
    SCRIPTS,
    run_script,
    run_together_on_a_free_port,
    script_env,
    small_wnut,
    state_dict_difference,
    tiny_sequence_tagger,
)

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SETTINGS: dict[str, Any] = {
    "max_epochs": 2,
    "mini_batch_size": 4,
    "learning_rate": 0.1,
    "shuffle": True,
    "embeddings_storage_mode": "none",
    "use_final_model_for_eval": True,
    "create_file_logs": False,
}


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[ColumnCorpus, MappedCorpus]:
    """WNUT-16 tweets in column files, read by flair's ColumnCorpus and mapped from the same files."""
    in_memory = small_wnut(tmp_path / "wnut", train_size=64, dev_size=10, test_size=10)
    mapped = MappedCorpus.from_column_files(
        tmp_path / "wnut", {0: "text", 1: WNUT16_LABEL_TYPE}, cache_folder=tmp_path / "cache"
    )
    return in_memory, mapped


def _trained(model: flair.nn.Model, corpus: flair.data.Corpus, folder: Path, **launch: Any) -> dict[str, torch.Tensor]:
    flair.set_seed(11)  # the shuffling seed comes from rank 0's generator
    FabricTrainer(model, corpus).train(folder, accelerator="cpu", devices=2, **launch, **SETTINGS)
    return model.state_dict()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("ddp_fork", {}),
        ("ddp_spawn", {}),
        ("ddp_fork", {"val_check_interval": 3}),
        ("ddp_fork", {"mini_batch_chunk_size": 2}),
        ("ddp_fork", {"mini_batch_chunk_size": "auto"}),
    ],
    ids=["fork", "spawn", "val_check_interval", "chunks", "auto-chunks"],
)
def test_two_ranks_train_on_a_mapped_corpus_as_on_the_corpus_in_memory(
    corpora: tuple[ColumnCorpus, MappedCorpus], tmp_path: Path, strategy: str, options: dict[str, Any]
) -> None:
    in_memory, mapped = corpora
    model = tiny_sequence_tagger(in_memory)
    twin = copy.deepcopy(model)
    reference = _trained(model, in_memory, tmp_path / "memory", strategy=strategy, **options)
    ours = _trained(twin, mapped, tmp_path / "mapped", strategy=strategy, **options)
    assert state_dict_difference(ours, reference) == 0.0
    assert _without_timestamps(tmp_path / "mapped") == _without_timestamps(tmp_path / "memory")
    assert state_dict_difference(ours, tiny_sequence_tagger(in_memory).state_dict()) > 1e-3, "it trained"


def _without_timestamps(run: Path) -> list[list[str]]:
    """The rows of a run's loss.tsv, without the TIMESTAMP column."""
    rows = [line.split("\t") for line in (run / "loss.tsv").read_text().splitlines()]
    column = rows[0].index("TIMESTAMP")
    return [row[:column] + row[column + 1 :] for row in rows]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "launcher",
    [None, [TORCHRUN, "--standalone", "--nproc_per_node=2"], "slurm"],
    ids=["relaunch", "torchrun", "slurm"],
)
def test_relaunched_ranks_open_one_cache_and_train_as_on_the_corpus_in_memory(
    corpora: tuple[ColumnCorpus, MappedCorpus], tmp_path: Path, launcher: list[str] | str | None
) -> None:
    """The script relaunch, torchrun and two SLURM tasks: every rank opens the corpus from the column files through a
    new cache folder (one rank builds the entry, the other waits and opens it)."""
    in_memory, _ = corpora
    reference = _trained(tiny_sequence_tagger(in_memory), in_memory, tmp_path / "memory", strategy="ddp_fork")
    out = tmp_path / "relaunched"
    out.mkdir()
    config = {"folder": str(tmp_path / "wnut"), "cache": str(tmp_path / "new-cache"), "out": str(out)}
    (out / "config.json").write_text(json.dumps({**config, "settings": SETTINGS}), encoding="utf-8")
    if launcher == "slurm":
        _run_as_two_slurm_tasks(out / "config.json")
    else:
        run_script("mapped_training.py", str(out / "config.json"), launcher=launcher)
    built = sorted(json.loads(path.read_text(encoding="utf-8")) for path in out.glob("built-*.json"))
    assert built == [False, True], "one rank built the cache entry, the other opened it"
    weights = sorted(out.glob("weights-*.pt"))
    assert len(weights) == 2
    for path in weights:
        assert state_dict_difference(torch.load(path, weights_only=True), reference) == 0.0, path.name


def _run_as_two_slurm_tasks(config: Path) -> None:
    """The script as the two tasks of a one-node SLURM job (what srun starts), meeting on a free port."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    slurm |= {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "flair-fabric-test", "MASTER_ADDR": "127.0.0.1"}
    run_together_on_a_free_port(
        lambda port: [
            (
                [sys.executable, str(SCRIPTS / "mapped_training.py"), str(config)],
                script_env(**slurm, MASTER_PORT=str(port), SLURM_PROCID=str(task), SLURM_LOCALID=str(task)),
            )
            for task in (0, 1)
        ]
    )


def test_balancing_reads_the_stored_lengths_without_building_a_data_point(
    corpora: tuple[ColumnCorpus, MappedCorpus], monkeypatch: pytest.MonkeyPatch
) -> None:
    in_memory, mapped = corpora
    expected = [data_point_length(in_memory.train[index]) for index in range(len(in_memory.train))]

    def no_building(self: MappedSplit, index: int) -> None:
        raise AssertionError(f"data point {index} was built")

    monkeypatch.setattr(MappedSplit, "__getitem__", no_building)
    assert data_point_lengths(mapped.train) == expected


def test_subsets_and_concatenations_of_mapped_splits_answer_their_stored_lengths(
    corpora: tuple[ColumnCorpus, MappedCorpus],
) -> None:
    in_memory, mapped = corpora
    lengths = [data_point_length(in_memory.train[index]) for index in range(len(in_memory.train))]
    dev_lengths = [data_point_length(in_memory.dev[index]) for index in range(len(in_memory.dev))]
    assert stored_lengths(Subset(mapped.train, [5, 3, 5])) == [lengths[5], lengths[3], lengths[5]]
    assert stored_lengths(ConcatDataset([mapped.train, mapped.dev])) == lengths + dev_lengths
    assert stored_lengths(ConcatDataset([mapped.train, in_memory.dev])) is None, "flair's split stores none"


def test_a_spawned_worker_receives_a_split_as_its_path_not_its_data(
    corpora: tuple[ColumnCorpus, MappedCorpus],
) -> None:
    in_memory, mapped = corpora
    payload = transport.dumps(mapped.train)
    assert len(payload) < len(transport.dumps(in_memory.train)) / 10
    crossed = transport.loads(payload)
    assert [crossed[i].to_tagged_string() for i in range(len(crossed))] == [
        in_memory.train[i].to_tagged_string() for i in range(len(in_memory.train))
    ]


def test_no_embedding_stays_on_a_mapped_data_point_after_an_evaluation(
    corpora: tuple[ColumnCorpus, MappedCorpus],
) -> None:
    """flair's default storage mode keeps an evaluation's embeddings on in-memory sentences; a mapped data point is
    built anew at every read."""
    in_memory, mapped = corpora
    model = tiny_sequence_tagger(in_memory)
    model.evaluate(in_memory.dev, WNUT16_LABEL_TYPE, embedding_storage_mode="cpu")
    assert in_memory.dev[0][0].get_embedding().numel() > 0, "flair keeps them in memory (the reference)"
    model.evaluate(mapped.dev, WNUT16_LABEL_TYPE, embedding_storage_mode="cpu")
    assert mapped.dev[0][0].get_embedding().numel() == 0


@pytest.mark.multiprocess
def test_a_mid_epoch_checkpoint_of_a_mapped_run_resumes_to_the_uninterrupted_weights(
    corpora: tuple[ColumnCorpus, MappedCorpus], tmp_path: Path
) -> None:
    """2 ranks, 8 steps an epoch, a checkpoint every 3 steps: the run resumed (in another base_path) from the one of
    step 12, in the middle of epoch 2, ends with the uninterrupted run's weights."""
    in_memory, mapped = corpora
    model = tiny_sequence_tagger(in_memory)
    resumed = copy.deepcopy(model)
    checkpoints = {"checkpoint_every_n_steps": 3, "keep_checkpoints": 10}
    uninterrupted = _trained(model, mapped, tmp_path / "whole", strategy="ddp_fork", **checkpoints)
    middle = tmp_path / "whole" / "checkpoints" / "step-000000012"
    assert middle.is_dir(), sorted(path.name for path in middle.parent.iterdir())
    ours = _trained(resumed, mapped, tmp_path / "resumed", strategy="ddp_fork", resume_from=str(middle), **checkpoints)
    assert state_dict_difference(ours, uninterrupted) == 0.0


@pytest.mark.multiprocess
def test_a_notebook_trains_on_a_mapped_corpus_as_on_the_corpus_in_memory(tmp_path: Path) -> None:
    """A real Jupyter kernel (forked workers, ``ddp_notebook``): the mapped corpus and flair's ColumnCorpus of the same
    files train the same model to the same weights."""
    small_wnut(tmp_path / "wnut", train_size=64, dev_size=10, test_size=10)
    source = f"""
import copy, json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, {str(REPO)!r})
import flair, torch
flair.device = torch.device("cpu")
from flair.datasets import ColumnCorpus
from flair_fabric import FabricTrainer
from flair_fabric.data import MappedCorpus
from tests.support import state_dict_difference, tiny_sequence_tagger
columns = {{0: "text", 1: "ner"}}
settings = json.loads({json.dumps(SETTINGS)!r})
in_memory = ColumnCorpus({str(tmp_path / "wnut")!r}, columns)
first = tiny_sequence_tagger(in_memory)
second = copy.deepcopy(first)
for corpus, model, folder in (
    (in_memory, first, {str(tmp_path / "memory")!r}),
    (MappedCorpus.from_column_files({str(tmp_path / "wnut")!r}, columns, cache_folder={str(tmp_path / "cache")!r}),
     second, {str(tmp_path / "mapped")!r}),
):
    flair.set_seed(11)
    FabricTrainer(model, corpus).train(folder, accelerator="cpu", devices=2, **settings)
print("DIFFERENCE:", state_dict_difference(first.state_dict(), second.state_dict()))
print("TRAINED:", state_dict_difference(first.state_dict(), tiny_sequence_tagger(in_memory).state_dict()))
"""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    printed = "".join(output.get("text", "") for output in notebook.cells[0].outputs if output.get("name") == "stdout")
    values = dict(line.split(": ", 1) for line in printed.splitlines() if line.startswith(("DIFFERENCE", "TRAINED")))
    assert float(values["DIFFERENCE"]) == 0.0, printed[-2000:]
    assert float(values["TRAINED"]) > 1e-3
