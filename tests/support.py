"""Small flair models and helpers shared by the tests and the multi-process test scripts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flair
import torch
from flair.data import Corpus
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings, TransformerDocumentEmbeddings
from flair.models import SequenceTagger, TextClassifier
from flair.samplers import FlairSampler
from flair.trainers.plugins import BasePlugin, Pluggable, TrainerPlugin
from lightning.fabric.connector import _PRECISION_INPUT
from torch.utils.data import RandomSampler

from flair_fabric.datasets import TREC_LABEL_TYPE, WNUT16_LABEL_TYPE, trec_corpus, wnut16_corpus
from flair_fabric.launch.runner import Job, run_job

REPO = Path(__file__).resolve().parents[1]

# flair arguments for runs whose weights are compared across launch methods: no shuffling, the final model
UNION = {"max_epochs": 3, "learning_rate": 0.1, "shuffle": False, "use_final_model_for_eval": True}
GROUPED_BY_2: dict[str, Any] = {"group_by_length": True, "group_by_length_window": 2}  # windows of two global batches
# a 2-rank run whose dev, train-sample and test evaluations are sharded (batches of 2) and drive annealing
ANNEALED = {
    "max_epochs": 4,
    "mini_batch_size": 4,
    "eval_batch_size": 2,
    "learning_rate": 2.0,
    "patience": 0,
    "monitor_train_sample": 0.25,
    "devices": 2,
}
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FABRIC_PRECISIONS = [value for choices in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(choices)]
"""Every spelling Fabric's ``precision`` takes (``"bf16-mixed"``, ``"64"``, ``32``, ``"transformer-engine"``, ...)."""


def small_trec(train_size: int = 48, dev_size: int = 12, test_size: int = 12, seed: int = 3) -> Corpus:
    """A few TREC questions."""
    return trec_corpus(train_size=train_size, dev_size=dev_size, test_size=test_size, seed=seed)


def small_wnut(folder: str | Path, train_size: int = 40, dev_size: int = 10, test_size: int = 10) -> Corpus:
    """A few WNUT-16 tweets as a flair ColumnCorpus."""
    return wnut16_corpus(folder, train_size=train_size, dev_size=dev_size, test_size=test_size, seed=3)


def tiny_text_classifier(
    corpus: Corpus, seed: int = 7, model_class: type[TextClassifier] = TextClassifier, **options: Any
) -> TextClassifier:
    """A one-hot + mean-pooling text classifier without dropout (deterministic).

    Not flair's DocumentRNNEmbeddings: it zeroes its own gradients in every forward pass, so with
    ``mini_batch_chunk_size`` it keeps only the last chunk's gradient, in flair's own trainer as well.
    """
    flair.set_seed(seed)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=16)
    document = DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return model_class(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels, **options)


def tiny_sequence_tagger(
    corpus: Corpus,
    seed: int = 7,
    model_class: type[SequenceTagger] = SequenceTagger,
    tag_type: str = WNUT16_LABEL_TYPE,
    use_crf: bool = True,
) -> SequenceTagger:
    """A one-hot + LSTM (+ CRF) tagger without dropout (deterministic); NER spans by default."""
    flair.set_seed(seed)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=16)
    tags = corpus.make_label_dictionary(tag_type, add_unk=False)
    return model_class(
        hidden_size=16,
        embeddings=words,
        tag_dictionary=tags,
        tag_type=tag_type,
        use_crf=use_crf,
        dropout=0.0,
        word_dropout=0.0,
        locked_dropout=0.0,
    )


def make_tiny_bert(directory: str | Path, corpus: Corpus, seed: int = 0, max_positions: int = 64) -> Path:
    """A randomly initialised 2-layer BERT without dropout and its word-piece tokenizer, saved in ``directory``."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    words = sorted({token.text.lower() for sentence in corpus.get_all_sentences() for token in sentence})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=True).save_pretrained(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0,  # deterministic: N ranks can be compared with one process
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(directory)
    return directory


def tiny_transformer_classifier(corpus: Corpus, bert_dir: str | Path, seed: int = 7) -> TextClassifier:
    """A text classifier on a tiny random BERT (``make_tiny_bert``), fine-tuned end to end."""
    flair.set_seed(seed)
    embeddings = TransformerDocumentEmbeddings(str(bert_dir), fine_tune=True)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


class RemembersPredictions:
    """Mixin for a flair model: keeps the text of every data point its ``predict`` is called with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.predicted_texts: list[str] = []

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        batch = sentences if isinstance(sentences, list) else [sentences]
        self.predicted_texts.extend(sentence.to_original_text() for sentence in batch)
        return super().predict(sentences, *args, **kwargs)  # type: ignore[misc]


class CountingTextClassifier(RemembersPredictions, TextClassifier):
    """A TextClassifier that remembers what it predicted."""


class CountingSequenceTagger(RemembersPredictions, SequenceTagger):
    """A SequenceTagger that remembers what it predicted."""


class EventRecorder(TrainerPlugin):
    """Records every trainer event with a comparable summary of its arguments."""

    EVENTS = (
        "after_setup",
        "before_training_epoch",
        "before_training_batch",
        "before_training_optimizer_step",
        "after_training_batch",
        "after_training_epoch",
        "after_evaluation",
        "after_training_loop",
        "training_interrupt",
        "_training_finally",
        "_training_exception",
        "after_training",
        "metric_recorded",
    )

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def attach_to(self, pluggable: Pluggable) -> None:
        BasePlugin.attach_to(self, pluggable)
        for event in self.EVENTS:
            self._hook_handles.append(pluggable.register_hook(self._recorder(event), event))

    def _recorder(self, event: str):
        def record(*args: Any, **kwargs: Any) -> None:
            summary = {key: summarize(value) for key, value in kwargs.items()}
            if args:
                metric = args[0]
                summary = {"name": str(metric.name), "step": metric.global_step, "value": summarize(metric.value)}
            self.events.append((event, summary))

        return record


def summarize(value: Any) -> Any:
    """A JSON-like stand-in for an event argument that two runs can be compared on."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else ("tensor", tuple(value.shape))
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return "<path>"
    if isinstance(value, (list, tuple)):
        if value and all(hasattr(item, "to_plain_string") for item in value):
            return ("batch", tuple(item.to_plain_string() for item in value))
        return tuple(summarize(item) for item in value)
    return f"<{type(value).__name__}>"


def state_dict_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[key].float() - b[key].float()).abs().max().item() for key in a)


class ProcessInfo(typing.NamedTuple):
    """One line of ``/proc/<pid>/stat``, the fields the tests read."""

    pid: int
    state: str  # "Z": a zombie
    parent: int
    group: int


def processes() -> list[ProcessInfo]:
    """Every process of this machine's process table (from /proc; processes that end meanwhile are left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": the name may hold spaces
        except OSError:
            continue
        found.append(ProcessInfo(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


class RunCrashed(Exception):
    """A process or run the test started ended with an error the test did not expect. The test fails, but the
    mutation check does not count it as catching a deliberate bug: only an assertion of the test's own, or an error
    it expected by type, does (docs/testing.md)."""


class RunHung(Exception):
    """A process or run the test started did not end in time, or its ranks fell out of step (a collective timed out,
    or met another collective). The mutation check counts it as a catch only for the claims about hanging and
    lockstep (``hangs = true`` in tests/mutations/)."""


OUT_OF_STEP = re.compile(
    r"waited longer than collective_timeout|[Tt]imed out|[Cc]onnection closed by peer|size doesn't match|size mismatch"
)
"""What a run's error says when its ranks fell out of step: flair-fabric's collective timeout, gloo's errors."""


@contextlib.contextmanager
def out_of_step_is_a_hang() -> Iterator[None]:
    """A run in the block that ends because its ranks fell out of step raises :class:`RunHung` (other errors pass)."""
    try:
        yield
    except Exception as error:
        if OUT_OF_STEP.search(str(error)):
            raise RunHung(f"the ranks fell out of step: {type(error).__name__}: {error}"[:6000]) from error
        raise


def recording_new_groups(monkeypatch: Any, record: Path) -> None:
    """Every ``torch.distributed.new_group`` call from now on (in forked workers too) first appends
    ``"<global rank> <backend> <timeout in seconds>"`` to ``record``."""
    make = torch.distributed.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        with Path(record).open("a") as stream:
            seconds = None if timeout is None else timeout.total_seconds()
            stream.write(f"{torch.distributed.get_rank()} {kwargs.get('backend')} {seconds}\n")
        return make(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "new_group", new_group)


def counting_saves(record: Path, save: Any) -> Any:
    """flair's ``Model.save`` (``save``) that first appends ``"<global rank> <model file name>"`` to ``record``: every
    model file written, by whom (a temporary file ``.final-model.pt.<random>.tmp`` that is renamed into place counts
    as ``final-model.pt``). Set as ``flair.nn.Model.save`` before forking or in a script, it counts on every rank."""

    def counted(self: Any, model_file: Any, checkpoint: bool = False) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        name = Path(model_file).name
        if name.startswith(".") and name.endswith(".tmp"):
            name = name[1:].rsplit(".", 2)[0]
        with Path(record).open("a") as stream:
            stream.write(f"{rank} {name}\n")
        return save(self, model_file, checkpoint)

    return counted


def no_training_may_start(monkeypatch: Any) -> None:
    """``FabricTrainer`` going on to start its job (build its Fabric, start its processes) fails the test at once: a
    refusal "before launch" must come first. (An unrefused run would otherwise train, or fail later with some error
    of its own, which is not the refusal the test expects.)"""
    import flair_fabric.trainer

    def started(*args: Any, **kwargs: Any) -> None:
        import pytest

        pytest.fail("the run went on to start its job instead of refusing its arguments before launch")

    monkeypatch.setattr(flair_fabric.trainer, "run_job", started)


def expect_success(returncode: int, what: str, output: str) -> None:
    """Raise :class:`RunCrashed` with the output's tail when ``what`` ended with a non-zero exit code."""
    if returncode != 0:
        raise RunCrashed(f"{what} failed with exit code {returncode}:\n{output[-6000:]}")


def run_script(
    script: str,
    *args: str,
    timeout: int = 240,
    launcher: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> str:
    """Run ``tests/scripts/<script>`` in a fresh interpreter (the way a user runs a training script); its output.
    A non-zero exit raises :class:`RunCrashed`, a run past ``timeout`` :class:`RunHung`."""
    command = [*(launcher or [sys.executable]), str(SCRIPTS / script), *args]
    return run_command(command, script, timeout, extra_env)


def run_command(command: list[str], script: str, timeout: int = 240, extra_env: dict[str, str] | None = None) -> str:
    """Run ``command`` from the repository (offline, this checkout importable); its output, as :func:`run_script`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.update(extra_env or {})
    env.pop("LOCAL_RANK", None)
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as stuck:  # a hang ends the test (rather than the test timeout ending it)
        tail = f"{str(stuck.stdout)[-3000:]} {str(stuck.stderr)[-3000:]}"
        raise RunHung(f"{script} did not end within {timeout} s: {tail}") from None
    output = completed.stdout + completed.stderr
    expect_success(completed.returncode, script, output)
    return output


def loss_file_column(folder: Path, column: str) -> list[float]:
    """One column of ``folder/loss.tsv`` (flair's per-evaluation rows), as numbers."""
    rows = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    return [float(row[rows[0].index(column)]) for row in rows[1:]]


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """Write a JSON run configuration for a test script."""
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


class FunctionJob(Job):
    """A job of the runner that calls ``function(fabric, argument)`` on every rank (module-level functions only: spawned
    workers import them)."""

    def __init__(self, function: Any, argument: Any, result_types: tuple[type, ...] = ()) -> None:
        super().__init__()
        self.function, self.argument = function, argument
        self.result_types = result_types  # type: ignore[misc]

    def run_on_rank(self, fabric: Any) -> Any:
        return self.function(fabric, self.argument)


def run_on_ranks(config: Any, function: Any, argument: Any, result_types: tuple[type, ...] = ()) -> Any:
    """``function(fabric, argument)`` on every rank of the processes ``config`` (a LaunchConfig) describes; the
    caller's own rank's result, or rank 0's after workers."""
    return run_job(FunctionJob(function, argument, result_types), config)


def free_port() -> int:
    """A port of 127.0.0.1 free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def run_together_on_a_free_port(commands_for: Any, attempts: int = 3) -> list[str]:
    """Start the processes ``commands_for(port)`` at once and wait for all (each must exit 0); they agree on a port
    chosen beforehand, and a port another program takes between the choice and the bind is tried again with a new
    one (not a failure of the code under test)."""
    for attempt in range(attempts):
        processes = [
            subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for cmd, env in commands_for(free_port())
        ]
        outputs = [process.communicate(timeout=420)[0] for process in processes]
        if all(process.returncode == 0 for process in processes):
            return outputs
        if attempt + 1 < attempts and any(taken in output for output in outputs for taken in _PORT_TAKEN):
            continue
        failed = next(process for process in processes if process.returncode)
        expect_success(failed.returncode, " ".join(failed.args), outputs[processes.index(failed)])
    raise RunCrashed(f"no free port in {attempts} attempts")


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a script run by a test: offline, the repository importable, no inherited rank."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO), **extra}
    env.pop("LOCAL_RANK", None)
    return env


class GroupedByLength(FlairSampler):
    """docs/launching.md's group_by_length written out as a sampler for flair's own trainer: the order flair's
    shuffling draws (torch's RandomSampler), cut into windows of ``window`` batches; each window sorted by length
    (words; longest first, equal lengths in the drawn order) and cut into batches, its whole batches shuffled by
    ``torch.randperm`` (a short last batch stays last); then the epoch's batch with the most padded positions moves
    to the front."""

    def __init__(self, batch_size: int, window: int) -> None:  # (flair's own call Sampler.__init__(None))
        self.batch_size, self.window = batch_size, window

    def __iter__(self) -> Iterator[int]:
        order = list(RandomSampler(range(self.num_samples)))
        lengths = [len(self.data_source[index]) for index in range(self.num_samples)]
        size, batches = self.batch_size, []
        for start in range(0, len(order), size * self.window):
            in_window = sorted(order[start : start + size * self.window], key=lambda index: -lengths[index])
            cut = [in_window[k : k + size] for k in range(0, len(in_window), size)]
            whole, short = [each for each in cut if len(each) == size], [each for each in cut if len(each) < size]
            batches += [whole[position] for position in torch.randperm(len(whole)).tolist()] + short
        costs = [len(each) * max(lengths[index] for index in each) if len(each) == size else -1 for each in batches]
        batches.insert(0, batches.pop(costs.index(max(costs))))
        return iter([index for each in batches for index in each])


def bio_tags(sentence: Any, label_type: str) -> list[str]:
    """A sentence's spans of ``label_type`` as one BIO tag per token (``B-PER``, ``I-PER``, ``O``)."""
    tags = ["O"] * len(sentence)
    for span in sentence.get_spans(label_type):
        first = span.tokens[0].idx - 1
        tags[first : first + len(span)] = [f"B-{span.tag}"] + [f"I-{span.tag}"] * (len(span) - 1)
    return tags


def tiny_classifier_file(folder: Path) -> Path:
    """A tiny TREC classifier trained for one epoch by flair's ``ModelTrainer`` in ``folder``: its final-model.pt."""
    from flair.trainers import ModelTrainer

    corpus = small_trec()
    ModelTrainer(tiny_text_classifier(corpus), corpus).train(folder, max_epochs=1, mini_batch_size=8)
    return folder / "final-model.pt"


def kill_with_descendants(pid: int) -> None:
    """SIGKILL a process and every process under it, found by their parents in /proc (torchrun starts its workers in
    sessions of their own, out of reach of a process-group kill): a machine that dies."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, queue = [], [pid]
    while queue:
        current = queue.pop()
        doomed.append(current)
        queue += children.get(current, [])
    for each in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)
