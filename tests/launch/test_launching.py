"""Every way to start a run: spawn, fork, torchrun over two "nodes", SLURM, two runs at once; and their errors."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.data import Sentence
from flair.models import SequenceTagger, TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

import flair_fabric.launch.runner as runner_module
from flair_fabric import FabricTrainer

from ..plugin_support import ListeningSockets
from ..support import (
    REPO,
    SCRIPTS,
    UNION,
    RunHung,
    expect_success,
    make_tiny_bert,
    run_together_on_a_free_port,
    script_env,
    small_trec,
    small_wnut,
    state_dict_difference,
    tiny_sequence_tagger,
    tiny_text_classifier,
    tiny_transformer_classifier,
    write_config,
)
from .test_rendezvous_and_hand_off import loopback_interfaces, non_loopback_address

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: int = 420) -> list[str]:
    """Start several processes at once and wait for all; each must exit 0."""
    processes = [
        subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in commands
    ]
    outputs = []
    for process in processes:
        output, _ = process.communicate(timeout=timeout)
        expect_success(process.returncode, " ".join(process.args), output)
        outputs.append(output)
    return outputs


def _final_weights(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / f"weights-rank{rank}.pt")["final"]


def _predictions(model: flair.nn.Model, texts: list[str], label_type: str) -> list[str]:
    sentences = [Sentence(text) for text in texts]
    model.predict(sentences)
    return [str(sentence.get_labels(label_type)) for sentence in sentences]


pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn"])
def test_spawn_and_fork_train_the_same_weights_as_the_script_relaunch(
    strategy: str, two_rank_runs: Path, tmp_path: Path
) -> None:
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    parameters = list(model.parameters())
    port_before = os.environ.get("MASTER_PORT")
    result = FabricTrainer(model, corpus).train_custom(
        tmp_path,
        **UNION,
        mini_batch_size=4,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[ListeningSockets(tmp_path), _AddsItsRank()],
    )
    # train returns rank 0's dictionary: flair's test score (the script relaunch's) and what a plugin added there
    relaunched = json.loads((two_rank_runs / "union" / "summary-rank0.json").read_text())["result"]["test_score"]
    assert result == {"test_score": relaunched, "added_by_plugin": 0}
    # nothing the run opened can be reached from another host: the store this process hosts, the workers' gloo
    listening = json.loads((tmp_path / "listening.json").read_text())
    assert listening and all(address.startswith(("127.0.0.1:", "::1:")) for _, address in listening), listening
    # the port the launcher picked does not stay behind for the next run or a subprocess to collide on
    assert os.environ.get("MASTER_PORT") == port_before
    # the caller's model holds the trained weights: the same as the 2-rank run started by `python script.py`
    assert state_dict_difference(model.state_dict(), _final_weights(two_rank_runs / "union", 0)) <= 1e-6
    written = TextClassifier.load(tmp_path / "final-model.pt")
    assert state_dict_difference(model.state_dict(), written.state_dict()) == 0.0
    # and it is in the state flair's trainer leaves a model in: eval mode, a model card, its device
    reference = tiny_text_classifier(corpus)
    ModelTrainer(reference, corpus).train_custom(tmp_path / "flair", **UNION, mini_batch_size=8)
    assert model.training is reference.training is False
    assert model.model_card is not None and set(model.model_card) == set(reference.model_card)
    parameters_card = model.model_card.get("training_parameters", {})
    assert parameters_card.get("max_epochs") == reference.model_card["training_parameters"]["max_epochs"] == 3
    assert next(model.parameters()).device == next(reference.parameters()).device
    # docs/notebooks.md: the model keeps its device: the trained weights are copied into its own parameters (on the
    # caller's flair.device), not replaced by the workers' CPU tensors
    assert all(mine is kept for mine, kept in zip(parameters, model.parameters(), strict=True)), "parameters replaced"


class _AddsItsRank(TrainerPlugin):
    """Adds the rank it ran on to the trainer's return values after the last epoch (on every rank)."""

    @TrainerPlugin.hook
    def after_training_loop(self, **kw: Any) -> None:
        self.trainer.return_values["added_by_plugin"] = self.trainer.global_rank


PIPE_BUFFER = 65536  # Linux: a result larger than this blocks a pipe nobody reads before the workers exit


def test_spawn_trains_a_transformer_classifier_and_the_caller_predicts_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[tuple[Path, int, int]] = []  # the file rank 0's results came back through: its mode and size
    load_data = runner_module.load_data

    def recording(path: Path, *args: Any, **kwargs: Any) -> Any:
        handed.append((Path(path), stat.S_IMODE(Path(path).parent.stat().st_mode), Path(path).stat().st_size))
        return load_data(path, *args, **kwargs)

    monkeypatch.setattr(runner_module, "load_data", recording)
    corpus = small_trec()
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        FabricTrainer(model, corpus).fine_tune(
            tmp_path / "run",
            max_epochs=2,
            mini_batch_size=4,
            learning_rate=5e-3,
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
        )
    finally:  # checked whatever came of the run (through Lightning's queue the weights are gone when it is read)
        # rank 0's results and weights came back through one file larger than a pipe's buffer, in a folder of the
        # user's alone
        assert [(mode, size > PIPE_BUFFER) for _, mode, size in handed] == [(0o700, True)]
    assert state_dict_difference(before, model.state_dict()) > 1e-4
    written = TextClassifier.load(tmp_path / "run" / "final-model.pt")  # fine_tune evaluates the final model
    assert state_dict_difference(model.state_dict(), written.state_dict()) == 0.0
    texts = ["What is the capital of France ?", "Who wrote Hamlet ?", "How many legs has a spider ?"]
    assert _predictions(model, texts, "question_class") == _predictions(written, texts, "question_class")
    assert not handed[0][0].parent.exists(), "the file's folder is removed afterwards"


def test_spawn_trains_a_sequence_tagger_on_ner_spans_and_the_caller_gets_the_best_model(tmp_path: Path) -> None:
    corpus = small_wnut(tmp_path / "wnut")  # sentences with span labels: plain pickling fails on them
    model = tiny_sequence_tagger(corpus)
    FabricTrainer(model, corpus).train(
        tmp_path / "run",
        max_epochs=3,
        mini_batch_size=8,
        learning_rate=0.1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
    )
    best = SequenceTagger.load(tmp_path / "run" / "best-model.pt")  # train() picks the best epoch on dev
    assert state_dict_difference(model.state_dict(), best.state_dict()) == 0.0
    final = SequenceTagger.load(tmp_path / "run" / "final-model.pt")  # the best epoch is not the last one here
    assert state_dict_difference(best.state_dict(), final.state_dict()) > 1e-4
    texts = ["Justin Bieber is in New York tonight", "going to the Apple store"]
    assert _predictions(model, texts, "ner") == _predictions(best, texts, "ner")


def test_two_nodes_without_a_shared_disk(tmp_path: Path) -> None:
    """Two torchrun "nodes" on one machine, each writing under its own folder; node 1 never sees node 0's files."""
    kwargs = {"max_epochs": 4, "mini_batch_size": 4, "devices": 1, "num_nodes": 2, "patience": 0}
    kwargs |= {"write_weights": True, "progress_bar": True}
    runs = [{"name": "nodes", "method": "train", "kwargs": {**kwargs, "anneal_with_restarts": True}, "counter": True}]
    predict = {"devices": 1, "num_nodes": 2, "accelerator": "cpu"}  # flair_fabric.predict after training
    config = {"out": str(tmp_path), "per_node_out": True, "runs": runs, "predict": predict}
    config = write_config(tmp_path / "config.json", config)

    def commands_for(port: int) -> list[tuple[list[str], dict[str, str]]]:
        return [
            (
                [
                    TORCHRUN,
                    "--nnodes=2",
                    "--nproc_per_node=1",
                    f"--node_rank={node}",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                    str(SCRIPTS / "ddp_runs.py"),
                    str(config),
                ],
                script_env(),
            )
            for node in (0, 1)
        ]

    # node 1 has a best-model.pt of its own, which it must never read: rank 0's file, read by rank 0, is the one
    # (reading this one would run its code: the marker)
    node0, node1 = tmp_path / "node0" / "nodes", tmp_path / "node1" / "nodes"
    node1.mkdir(parents=True)
    marker = tmp_path / "node-1-read-its-own-best-model"
    torch.save({"state_dict": _CreatesAFile(marker)}, node1 / "best-model.pt")
    decoy = (node1 / "best-model.pt").read_bytes()
    try:
        outputs = run_together_on_a_free_port(commands_for)
    finally:
        assert not marker.exists(), "node 1 read a best-model.pt: only global rank 0 may read it"

    assert {p.name for p in node0.iterdir()} >= {"training.log", "loss.tsv", "best-model.pt", "final-model.pt"}
    assert [p.name for p in node1.iterdir()] == ["best-model.pt"], "logs and models are written by global rank 0 only"
    assert (node1 / "best-model.pt").read_bytes() == decoy
    # global rank 0 alone logs (node 1's local rank 0 is silent), and states the global batch size
    assert outputs[0].count("EPOCH 1 done") == 1 and "EPOCH 1 done" not in outputs[1], outputs[1][-3000:]
    assert 'global batch size: "8" (2 process(es))' in (node0 / "training.log").read_text()
    results = tmp_path / "node1" / "results" / "nodes"
    assert (results / "summary-rank1.json").exists(), "node 1's process knows itself as global rank 1"
    rank1 = json.loads((results / "summary-rank1.json").read_text())
    assert (rank1["node_rank"], rank1["local_rank"], rank1["device"], rank1["world_size"]) == (1, 0, "cpu", 2)
    # anneal_with_restarts reloaded the best model on both nodes from rank 0's file, over the process group: the
    # weights agree at the start of every epoch (flair's plugin would skip the reload where the file is missing)
    assert "resetting to best model" in (node0 / "training.log").read_text() + outputs[0]
    rank0 = json.loads((tmp_path / "node0" / "results" / "nodes" / "summary-rank0.json").read_text())
    assert len(rank0["weight_trace"]) == 4 and rank0["weight_trace"] == rank1["weight_trace"]
    weights0 = _final_weights(tmp_path / "node0" / "results" / "nodes", 0)
    assert state_dict_difference(weights0, _final_weights(results, 1)) == 0.0
    assert state_dict_difference(weights0, TextClassifier.load(node0 / "best-model.pt").state_dict()) == 0.0
    assert (node0 / "weights.txt").exists(), "write_weights: the weights writer, on global rank 0 (node 1: nothing)"
    # inside hooks self.trainer tells node 1's process (local rank 0) from global rank 0, and so does the trainer after
    hooks = ("after_setup", "after_training_batch", "after_training_epoch")
    for summary, seen in ((rank0, [0, 0, 2, True]), (rank1, [1, 0, 2, False])):  # global, local, world, global zero
        assert summary["in_hooks"] == {hook: [seen] for hook in hooks}, summary["in_hooks"]
        assert summary["is_global_zero_after"] is seen[3]
    # a rank_zero_only hook runs on global rank 0 only, not on node 1's local rank 0; the every-rank hook on both
    assert (rank0["hook_counts"], rank1["hook_counts"]) == ([4, 4], [4, 0])
    # progress_bar=True: one bar per epoch, drawn by global rank 0; node 1's local rank 0 draws none
    started = re.findall(r"epoch (\d+): +0%\|[^\r\n]*\| 0/\d+ \[00:00<\?, \?step/s\]", outputs[0])
    assert started == ["1", "2", "3", "4"], started
    assert re.findall(r"epoch \d+: +\d+%", outputs[1]) == [], outputs[1][-3000:]
    # flair_fabric.predict in the trained processes: node 1's own sentences end with all of flair's labels
    for node in (0, 1):
        labels = json.loads((tmp_path / f"node{node}" / "results" / f"predicted-rank{node}.json").read_text())
        assert labels["ours"] == labels["flair"] and all(labels["ours"]), node


def test_an_elastic_torchrun_job_takes_its_number_of_nodes_from_the_agents(tmp_path: Path) -> None:
    """Two elastic agents (``--nnodes=1:2``, c10d rendezvous) on one machine, a script that names no ``num_nodes``
    (``"auto"``, the default): the job runs on the 2 nodes that joined, one world of 2 processes, ranks equal."""
    kwargs = {"max_epochs": 1, "mini_batch_size": 4, "devices": "auto", "accelerator": "cpu"}
    runs = [{"name": "elastic", "method": "train", "kwargs": kwargs}]
    config = write_config(tmp_path / "config.json", {"out": str(tmp_path), "runs": runs})

    def commands_for(port: int) -> list[tuple[list[str], dict[str, str]]]:
        elastic = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        elastic += ["--rdzv-id=elastic-test", "--local-addr=127.0.0.1", "--max-restarts=0"]
        return [([TORCHRUN, *elastic, str(SCRIPTS / "ddp_runs.py"), str(config)], script_env()) for _ in (0, 1)]

    run_together_on_a_free_port(commands_for)
    summaries = [json.loads((tmp_path / "elastic" / f"summary-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(summary["world_size"], summary["node_rank"]) for summary in summaries] == [(2, 0), (2, 1)]
    weights = [_final_weights(tmp_path / "elastic", rank) for rank in (0, 1)]
    assert state_dict_difference(weights[0], weights[1]) == 0.0


def test_slurm_job_with_two_tasks(tmp_path: Path) -> None:
    runs = [
        {
            "name": "slurm",
            "method": "train_custom",
            "kwargs": {**UNION, "mini_batch_size": 4, "devices": 2},
            "listening": True,
            "note_port": True,
        }
    ]
    config = write_config(tmp_path / "config.json", {"out": str(tmp_path), "runs": runs})
    slurm = {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "flair-fabric-test",
        "MASTER_ADDR": "127.0.0.1",
    }
    run_together_on_a_free_port(
        lambda port: [
            (
                [sys.executable, str(SCRIPTS / "ddp_runs.py"), str(config)],
                script_env(**slurm, MASTER_PORT=str(port), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
            )
            for rank in (0, 1)
        ]
    )
    run_dir = tmp_path / "slurm"
    assert state_dict_difference(_final_weights(run_dir, 0), _final_weights(run_dir, 1)) == 0.0
    summaries = [json.loads((run_dir / f"summary-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["world_size"] for s in summaries] == [2, 2] and [s["local_rank"] for s in summaries] == [0, 1]
    assert len({s["pid"] for s in summaries}) == 2, "SLURM started both tasks; nothing was relaunched"
    listening = json.loads((run_dir / "listening.json").read_text())  # one node: task 0 hosts the store on loopback
    listening = [(pid, address) for pid, address in listening if pid in {s["pid"] for s in summaries}]
    assert listening and all(address.startswith(("127.0.0.1:", "::1:")) for _, address in listening), listening
    # docs/security.md: the store is hosted by task 0, on loopback, and both tasks meet there
    port = summaries[0]["master_port"]
    assert summaries[1]["master_port"] == port
    assert [(pid, address) for pid, address in listening if address.endswith(f":{port}")] == [
        (summaries[0]["pid"], f"127.0.0.1:{port}")
    ]


def test_one_node_torchrun_keeps_the_rendezvous_and_the_collectives_on_loopback(tmp_path: Path) -> None:
    """docs/security.md: under a one-node torchrun, global rank 0 hosts the attempt's store on loopback (announced
    through torchrun's, whatever address torchrun was given) and gloo and NCCL use the loopback interface. torchrun is
    given an address of this machine other than loopback where it has one: its own store listens there (and on every
    interface), none of the ranks' sockets may."""
    address = non_loopback_address() or "127.0.0.1"
    env = script_env()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)

    def commands_for(port: int) -> list[tuple[list[str], dict[str, str]]]:
        options = ["--nnodes=1", "--nproc_per_node=2", f"--master_addr={address}", f"--master_port={port}"]
        return [([TORCHRUN, *options, str(SCRIPTS / "launch_environment.py"), str(tmp_path)], env)]

    run_together_on_a_free_port(commands_for)
    seen = [json.loads((tmp_path / f"environment-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(rank["environment"]["TORCHELASTIC_RUN_ID"] for rank in seen), "both ranks were started by torchrun"
    store = f"127.0.0.1:{seen[0]['environment']['MASTER_PORT']}"
    assert store in seen[0]["listening"], "global rank 0 hosts the attempt's store, on loopback"
    for rank in seen:
        assert rank["environment"]["MASTER_ADDR"] == "127.0.0.1", rank
        assert rank["listening"] and all(a.startswith(("127.0.0.1:", "::1:")) for a in rank["listening"]), rank
        interfaces = [rank["environment"][name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
        assert all(interface in loopback_interfaces() for interface in interfaces), rank


def test_two_runs_at_the_same_time_both_finish(tmp_path: Path) -> None:
    """docs/launching.md: each self-started run binds a free port of its own, so two runs on one machine both
    finish (the exit codes are the claim here)."""
    processes = []
    for name in ("first", "second"):
        kwargs = {**UNION, "mini_batch_size": 4, "devices": 2}
        runs = [{"name": name, "method": "train_custom", "kwargs": kwargs, "note_port": True}]
        config = write_config(tmp_path / f"{name}.json", {"out": str(tmp_path), "runs": runs})
        command = [sys.executable, str(SCRIPTS / "ddp_runs.py"), str(config)]
        processes.append(
            subprocess.Popen(
                command, env=script_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outputs = [process.communicate(timeout=420)[0] for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        raise RunHung("two runs at the same time did not end within 420 s") from None
    assert [process.returncode for process in processes] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    ports = []
    for name in ("first", "second"):
        assert (tmp_path / name / "final-model.pt").exists()
        assert state_dict_difference(_final_weights(tmp_path / name, 0), _final_weights(tmp_path / name, 1)) == 0
        seen = {
            json.loads((tmp_path / name / f"summary-rank{rank}.json").read_text())["master_port"] for rank in (0, 1)
        }
        assert len(seen) == 1 and None not in seen, seen  # both ranks of a run meet on one port
        ports.append(seen.pop())
    assert ports[0] != ports[1], ports


class _CreatesAFile:
    """Unpickling this object creates ``path``: shows that a file was read."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


class _DeviceSeen(TrainerPlugin):
    """Where a rank computes: flair.device and the device of the first batch's embeddings, on every rank."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def attach_to(self, pluggable: Any) -> None:
        """In set-up, before any pass: what flair.device says on this rank (a pass on a wrong device fails)."""
        super().attach_to(pluggable)
        rank = pluggable.global_rank
        seen = {"flair": str(flair.device), "fabric": str(pluggable.fabric.device), "parameter": None}
        (self.out / f"device-rank{rank}.json").write_text(json.dumps(seen))

    @TrainerPlugin.hook
    def before_training_batch(self, batch: list, batch_no: int, **kw: object) -> None:
        if batch_no == 0:  # before the first pass (which fails on a device nobody computes on)
            seen = {
                "flair": str(flair.device),
                "fabric": str(self.trainer.fabric.device),
                "parameter": str(next(self.model.parameters()).device),
            }
            (self.out / f"device-rank{self.trainer.global_rank}.json").write_text(json.dumps(seen))


def test_every_rank_computes_on_the_device_fabric_gives_it(tmp_path: Path) -> None:
    """The caller's flair.device is not the ranks' device (on a GPU machine: cuda:0 for every rank); each rank sets
    it from Fabric. Shown on CPU with a caller whose flair.device names a device nobody computes on."""
    corpus = small_trec()
    model = tiny_text_classifier(corpus)
    callers_device = flair.device
    flair.device = torch.device("meta")
    failed: Exception | None = None
    try:
        FabricTrainer(model, corpus).train(
            tmp_path,
            max_epochs=1,
            mini_batch_size=4,
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
            plugins=[_DeviceSeen(tmp_path)],
        )
    except Exception as error:  # what each rank's set-up saw is checked first, then the failure is raised
        failed = error
    finally:
        flair.device = callers_device
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"device-rank{rank}.json").read_text())
        assert seen["flair"] == seen["fabric"] == "cpu", (rank, seen)  # written in set-up, before any pass
        if failed is None:
            assert seen["parameter"] == "cpu", (rank, seen)
    if failed is not None:
        raise failed


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_forked_workers_after_the_caller_computed_on_several_threads_finish(tmp_path: Path, devices: int) -> None:
    """GNU OpenMP is not fork-safe: without one thread per forked worker, this run never ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # Lightning would otherwise give 2 workers one thread each
    command = [sys.executable, str(SCRIPTS / "fork_after_openmp.py"), str(tmp_path), str(devices)]
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired as stuck:
        raise RunHung(f"the forked workers hang: {stuck}") from None
    expect_success(completed.returncode, "fork_after_openmp.py", completed.stderr)
    assert "workers computed with 1 thread(s); this process with 2" in completed.stdout
