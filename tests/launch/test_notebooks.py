"""Training from a real Jupyter kernel (ipykernel, driven by nbclient and jupyter_client): forked workers, the model
handed back as flair's trainer leaves it, readable output, and interrupts sent the ways Jupyter front ends send them."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from ..support import REPO, RunCrashed, RunHung, processes

pytestmark = pytest.mark.multiprocess

SETUP = f"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, {str(REPO)!r})
import flair, torch
flair.device = torch.device("cpu")
from flair.data import Sentence
from flair.trainers import ModelTrainer
from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier
corpus = small_trec()

import time
from flair.trainers.plugins import TrainerPlugin

class SlowToStop(TrainerPlugin):  # a model that takes a while to save: time for a second Ctrl-C
    @TrainerPlugin.hook
    def training_interrupt(self, **kw):
        time.sleep(20)

class SlowSetUp(TrainerPlugin):  # each worker's set-up takes a while: time for a Ctrl-C before epoch 1
    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def attach_to(self, pluggable):
        super().attach_to(pluggable)
        open(os.path.join(self.folder, f"setup-rank{{pluggable.global_rank}}"), "w").close()
        time.sleep(3)

_save = flair.nn.Model.save

def _noted_save(self, model_file, *args, **kwargs):  # every process's saves, the workers' included
    if os.environ.get("SAVES_NOTED_IN"):
        with open(os.environ["SAVES_NOTED_IN"], "a") as noted:
            noted.write(f"{{os.getpid()}} {{os.path.basename(str(model_file))}}\\n")
    return _save(self, model_file, *args, **kwargs)

flair.nn.Model.save = _noted_save
"""


def _notebook(*cells: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])


def _stream_text(cell: nbformat.NotebookNode, name: str) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.get("name") == name)


def test_a_notebook_trains_with_forked_workers_and_gets_the_model_back_as_flair_leaves_it(tmp_path: Path) -> None:
    notebook = _notebook(
        SETUP,
        # dropout makes train mode visible: evaluating in train mode gives a different loss each time
        f"""
model = tiny_text_classifier(corpus, dropout=0.5)
result = FabricTrainer(model, corpus).train({str(tmp_path / "fabric")!r}, max_epochs=2, mini_batch_size=4,
                                            devices=2, accelerator="cpu")
""",
        # flair's own trainer in a cell of its own: its bars are not the run's
        f"""
reference = tiny_text_classifier(corpus, dropout=0.5)
ModelTrainer(reference, corpus).train({str(tmp_path / "flair")!r}, max_epochs=2, mini_batch_size=8)
""",
        # what the cells see is printed and checked here (an assert in a cell would end the notebook as an error)
        """
import json
losses = [model.evaluate(corpus.test, gold_label_type=model.label_type, mini_batch_size=4).loss for _ in range(3)]
card = model.model_card or {}
print("STATE:", json.dumps({
    "training": [model.training, reference.training],
    "losses": [float(loss) for loss in losses],
    "card": sorted(card),
    "reference_card": sorted(reference.model_card),
    "parameters": {key: str(value) for key, value in card.get("training_parameters", {}).items()},
    "reference_parameters": {key: str(value) for key, value in reference.model_card["training_parameters"].items()},
    "devices": [str(next(model.parameters()).device), str(next(reference.parameters()).device)],
}))
""",
        f"""
FabricTrainer(model, corpus).fine_tune({str(tmp_path / "again")!r}, max_epochs=1, mini_batch_size=4, devices=2,
                                       accelerator="cpu")
sentence = Sentence("What is the capital of France ?")
model.predict(sentence)
print("PREDICTED:", [label.value for label in sentence.get_labels(model.label_type)])
""",
        f"""
for strategy in ("ddp_spawn", "ddp"):
    try:
        FabricTrainer(model, corpus).train({str(tmp_path)!r} + "/" + strategy, devices=2, accelerator="cpu",
                                           strategy=strategy)
    except ValueError as error:
        print("REFUSED:", error)
""",
    )
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    training = notebook.cells[1]
    stdout, stderr = _stream_text(training, "stdout"), _stream_text(training, "stderr")
    banners = [line for line in stderr.splitlines() if "Initializing distributed" in line]
    assert len(banners) == 1 and "GLOBAL_RANK: 0," in banners[0], banners  # rank 0's, once
    # docs/notebooks.md: progress_bar=None (the default) shows a text bar per epoch in a notebook, written by rank 0
    # to stdout
    assert all(re.search(rf"epoch {epoch}: +100%\|", stdout) for epoch in (1, 2)), "no bar in:\n" + stdout[-2000:]
    # flair's own evaluation bar, which would count the replay of the gathered predictions, is hidden (a bar over
    # a split's batches, "3/3 [..."; the label dictionary's "48it [..." is the cell's own)
    assert not re.search(r"\d+/\d+ \[", stderr), "a bar over batches in stderr:\n" + stderr[-2000:]
    # only global rank 0 logs: each line once, although both workers write to the kernel's output
    assert (stdout + stderr).count("EPOCH 1 done") == 1, "logged by several ranks:\n" + stdout[-2000:]
    # the model as flair's trainer leaves it: eval mode (the same loss every time), flair's model card, its device
    state = json.loads(_stream_text(notebook.cells[3], "stdout").split("STATE:", 1)[1])
    assert state["training"] == [False, False]
    assert len(set(state["losses"])) == 1, state["losses"]
    assert state["card"] == state["reference_card"]
    parameters, reference = state["parameters"], state["reference_parameters"]
    assert parameters.get("devices") == "2" and parameters.get("max_epochs") == reference["max_epochs"] == "2"
    # every training parameter flair writes, with flair's value but where the two runs were given other ones
    differing = sorted(name for name in reference if parameters.get(name) != reference[name])
    assert differing == ["base_path", "kwargs", "mini_batch_size", "plugins"], (differing, parameters, reference)
    assert state["devices"] == ["cpu", "cpu"]
    predicted = _stream_text(notebook.cells[4], "stdout")
    assert re.search(r"PREDICTED: \['\w+'\]", predicted), "the model predicts after a second run:\n" + predicted
    refusals = _stream_text(notebook.cells[5], "stdout").splitlines()
    assert len(refusals) == 2, refusals
    assert refusals[0].startswith("REFUSED: strategy='ddp_spawn' starts fresh Python processes"), refusals
    assert refusals[1].startswith("REFUSED: strategy='ddp' relaunches the running script"), refusals
    assert all("use strategy='ddp_notebook'" in line for line in refusals), refusals
    assert not (tmp_path / "ddp_spawn").exists() and not (tmp_path / "ddp").exists(), "a refused run created files"


TRAINING = """
os.environ["SAVES_NOTED_IN"] = {saves!r}
model = tiny_text_classifier(corpus)
before = {{name: tensor.clone() for name, tensor in model.state_dict().items()}}
FabricTrainer(model, corpus).train({path!r}, max_epochs=10_000, mini_batch_size=4, devices=2, accelerator="cpu",
                                   use_final_model_for_eval=True, min_learning_rate=0.0, plugins={plugins})
"""


@pytest.fixture(scope="module")
def kernel() -> Iterator[tuple[KernelManager, Any]]:
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(REPO))
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    reply = client.execute_interactive(SETUP, timeout=120)
    assert reply["content"]["status"] == "ok", reply
    yield manager, client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def _children_of(pid: int) -> list[str]:
    """The processes whose parent is ``pid`` (zombies included), as "pid state"."""
    return [f"{process.pid} {process.state}" for process in processes() if process.parent == pid]


def _wait_for_output(client: Any, msg_id: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if message["msg_type"] == "error" and message["parent_header"].get("msg_id") == msg_id:
            raise RunCrashed(f"the cell failed before {text!r}: {message['content'].get('evalue')}")
        if text in message["content"].get("text", ""):
            return
    raise RunHung(f"{text!r} never appeared in the cell's output within {timeout} s")


def _wait_for_files(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise RunHung(f"not every worker began its set-up within {timeout} s: {paths}")
        time.sleep(0.1)


def _printed(client: Any, code: str) -> str:
    """What a cell prints (a cell that fails is a crash: what it observed is checked by the test, not in the cell)."""
    texts: list[str] = []

    def keep(message: dict) -> None:
        if message["msg_type"] == "stream":
            texts.append(message["content"]["text"])

    reply = client.execute_interactive(code, timeout=60, output_hook=keep)
    if reply["content"]["status"] != "ok":
        raise RunCrashed(f"the cell failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    return "".join(texts)


def _largest_difference(client: Any, weights: str) -> float:
    """The largest difference between the kernel's model and ``weights`` (an expression of the kernel's)."""
    code = (
        f"reference = {weights}\n"
        "print('DIFFERENCE', max((t - reference[n]).abs().max().item() for n, t in model.state_dict().items()))"
    )
    return float(_printed(client, code).split("DIFFERENCE", 1)[1])


def _reply(client: Any, msg_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = client.get_shell_msg(timeout=1)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]
    raise RunHung(f"the cell did not end within {timeout} s of the interrupt")


def _output_until_idle(client: Any, msg_id: str, timeout: float) -> str:
    """The rest of a cell's streamed output, up to the kernel's idle status for it."""
    texts = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        texts.append(message["content"].get("text", ""))
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return "".join(texts)
    raise RunHung(f"the cell's output did not end within {timeout} s")


STALE_FINAL_MODEL = """
stale = tiny_text_classifier(corpus, seed=99)
stale.save({path!r})
os.utime({path!r}, (time.time() - 3600, time.time() - 3600))
"""


@pytest.mark.parametrize(
    ("target", "when", "times"),
    [
        ("kernel", "early", 1),  # VS Code signals the kernel's pid only; Ctrl-C before the first epoch
        ("kernel", "mid-epoch", 1),
        ("group", "mid-epoch", 1),  # Jupyter's interrupt button signals the kernel's process group
        ("kernel", "mid-epoch", 2),
        ("group", "mid-epoch", 2),
    ],
)
def test_an_interrupt_stops_every_worker_and_the_kernel_runs_on(
    kernel: tuple[KernelManager, Any], tmp_path: Path, target: str, when: str, times: int
) -> None:
    manager, client = kernel
    kernel_pid = manager.provisioner.process.pid  # type: ignore[union-attr]
    if times == 2:  # a final-model.pt of an earlier run in the folder; this run's workers never get to save one
        stale = client.execute_interactive(STALE_FINAL_MODEL.format(path=str(tmp_path / "final-model.pt")), timeout=60)
        assert stale["content"]["status"] == "ok", stale
    plugins = {2: "[SlowToStop()]", 1: "[]"}[times] if when == "mid-epoch" else f"[SlowSetUp({str(tmp_path)!r})]"
    saves = tmp_path / "saves.txt"
    msg_id = client.execute(TRAINING.format(path=str(tmp_path), plugins=plugins, saves=str(saves)))
    if when == "early":  # both workers are in their set-up (which lasts 3 s more)
        _wait_for_files([tmp_path / f"setup-rank{rank}" for rank in (0, 1)], timeout=120)
    else:
        _wait_for_output(client, msg_id, "EPOCH 1 done", timeout=120)
    for _ in range(times):
        if target == "kernel":
            os.kill(kernel_pid, signal.SIGINT)
        else:
            os.killpg(os.getpgid(kernel_pid), signal.SIGINT)
        time.sleep(0.5)
    interrupted = time.monotonic()
    reply = _reply(client, msg_id, timeout=60)
    assert time.monotonic() - interrupted < 30, "every rank stops within seconds"
    if times == 1:
        assert reply["status"] == "ok", reply  # flair's way: training stops, the final model is saved
        log = (tmp_path / "training.log").read_text()
        assert "SIGINT received by rank" in log and log.count("Saving model ...") == 1
        # saved once by all the processes together, and the kernel's model holds its weights
        noted = [line.split() for line in saves.read_text().splitlines()] if saves.exists() else []
        assert len([name for _, name in noted if "final-model.pt" in name]) == 1, noted
        assert _largest_difference(client, f"type(model).load({str(tmp_path / 'final-model.pt')!r}).state_dict()") == 0
        if when == "early":  # held from the workers' first moment: they stop at the start of epoch 1, untrained
            assert "EPOCH 1 done" not in log and "epoch 1 - iter" not in log, log[-2000:]
            assert _largest_difference(client, "before") == 0, "a step was trained after the interrupt"
    if times == 2:
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        # docs/notebooks.md: the workers saved no final-model.pt, so the model is left as it was, and a log line
        # says so (the older final-model.pt in the folder is not this run's)
        said = _output_until_idle(client, msg_id, timeout=30)
        assert "the workers were stopped before they saved a model: the model was not updated" in said, (
            "no log line says so:\n" + said[-2000:]
        )
        assert _largest_difference(client, "before") == 0, "the model's weights changed"
    deadline = time.monotonic() + 10
    while _children_of(kernel_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children_of(kernel_pid), "no worker is left, not even as a zombie"
    after = client.execute_interactive("print('kernel alive', model.training)", timeout=60)
    assert after["content"]["status"] == "ok"
