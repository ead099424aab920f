"""A tiny character language model on Jane Austen's text (flair_fabric/data/austen), for tests of seconds."""

from __future__ import annotations

import copy
import hashlib
import os
import random
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Dictionary
from flair.models import LanguageModel
from flair.trainers.language_model_trainer import TextCorpus

from flair_fabric.distributed.lockstep import Lockstep
from flair_fabric.language_model import trainer as language_model_trainer
from flair_fabric.language_model.loop import LanguageModelRun

LM_OPTIONS = {"sequence_length": 20, "max_epochs": 2, "num_workers": 0, "learning_rate": 5.0}
"""Two epochs (the second reads the split files in shuffled order), SGD with flair's plateau schedule."""
AUSTEN = Path(__file__).resolve().parents[2] / "flair_fabric" / "data" / "austen" / "persuasion.txt"


def write_tiny_corpus(folder: Path, splits: int = 3, split_chars: int = 3000, held_out_chars: int = 1200) -> Path:
    """``splits`` train split files, ``valid.txt`` and ``test.txt`` cut from Persuasion at line ends."""
    lines = [line for line in AUSTEN.read_text(encoding="utf-8").splitlines()[60:] if line.strip()]
    parts: list[list[str]] = []
    current: list[str] = []
    sizes = [split_chars] * splits + [held_out_chars, held_out_chars]
    for line in lines:
        current.append(line)
        if sum(len(text) + 1 for text in current) >= sizes[len(parts)]:
            parts.append(current)
            current = []
            if len(parts) == len(sizes):
                break
    (folder / "train").mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(parts[:splits], start=1):
        (folder / "train" / f"train_split_{index}").write_text("\n".join(part) + "\n", encoding="utf-8")
    (folder / "valid.txt").write_text("\n".join(parts[splits]) + "\n", encoding="utf-8")
    (folder / "test.txt").write_text("\n".join(parts[splits + 1]) + "\n", encoding="utf-8")
    return folder


def character_dictionary(folder: Path) -> Dictionary:
    """Every character of the corpus (and ``<unk>``)."""
    dictionary = Dictionary(add_unk=True)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            for char in sorted(set(path.read_text(encoding="utf-8"))):
                dictionary.add_item(char)
    return dictionary


def tiny_corpus(folder: Path, case_seed: int = 0, **options: int) -> TextCorpus:
    """A ``TextCorpus`` of :func:`write_tiny_corpus`'s files; flair flips the case of random lines of ``valid.txt``
    and ``test.txt`` as it reads them, with Python's generator seeded by ``case_seed``."""
    write_tiny_corpus(folder, **options)
    random.seed(case_seed)
    return TextCorpus(folder, character_dictionary(folder), forward=True, character_level=True)


def tiny_language_model(corpus: TextCorpus, seed: int = 1, dropout: float = 0.0) -> LanguageModel:
    """A forward character LSTM of 24 units (without dropout: N processes then train exactly as one)."""
    torch.manual_seed(seed)
    return LanguageModel(
        corpus.dictionary, is_forward_lm=True, hidden_size=24, nlayers=1, embedding_size=16, dropout=dropout
    )


def seeded(seed: int = 5) -> None:
    """The same generators before each of two runs that must match."""
    random.seed(seed)
    torch.manual_seed(seed)


def copy_model(model: LanguageModel) -> LanguageModel:
    """An independent copy with the same weights."""
    return copy.deepcopy(model)


def summaries(run: Path) -> list[str]:
    """The lines of ``loss.txt`` without their timings."""
    return [re.sub(r"time: +[0-9.]+s \| ", "", line) for line in (run / "loss.txt").read_text().splitlines()]


def validation_perplexities(run: Path) -> list[float]:
    """The validation perplexity of every line of ``loss.txt`` but the last (the test line)."""
    return [float(line.split("valid ppl")[1].split("|")[0]) for line in summaries(run)[:-1]]


def no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the job (building its Fabric, starting the ranks) fails the test at once: a refusal must come
    before."""

    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail("the run went on to build its Fabric or start its processes instead of refusing the arguments")

    monkeypatch.setattr(language_model_trainer, "run_job", started)


# --- what each rank did: journals and file accesses --------------------------------------------------------------


def digest(tensor: torch.Tensor) -> str:
    """A short digest of a tensor's values."""
    return hashlib.sha1(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


def generators_digest() -> str:
    """A short digest of this process's Python and torch generators."""
    state = repr(random.getstate()).encode() + torch.get_rng_state().numpy().tobytes()
    return hashlib.sha1(state).hexdigest()[:12]


def journaled(folder: Path) -> list[tuple[type, str, Any]]:
    """(class, name, method): ``LanguageModelRun.train_split`` and ``score`` and ``Lockstep.agree`` that append to
    ``folder/journal-RANK`` what the rank is about to do, before it does it: the split it trains (its text and the
    generators when it starts), the held-out text it scores (and the generators then; after the score, the loss it
    got), the agreement on stopping. Each line is written before the rank enters the step's collectives, so ranks
    that fall out of step leave journals that differ at the entry where they parted. Set them on the classes (forked
    ranks inherit them; a relaunched script sets them itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    train_split, score, agree = LanguageModelRun.train_split, LanguageModelRun.score, Lockstep.agree

    def note(run: LanguageModelRun | Lockstep, line: str) -> None:
        with open(folder / f"journal-{run.fabric.global_rank}", "a") as stream:
            stream.write(f"{line}\n")

    def journaled_train_split(
        self: LanguageModelRun,
        module: Any,
        optimizer: Any,
        train_slice: torch.Tensor,
        epoch: int,
        split_number: int,
        number_of_splits: int,
    ) -> None:
        note(
            self,
            f"train epoch {epoch + 1} split {split_number} text {digest(train_slice)} generators {generators_digest()}",
        )
        train_split(self, module, optimizer, train_slice, epoch, split_number, number_of_splits)

    def journaled_score(self: LanguageModelRun, text: torch.Tensor) -> float:
        note(self, f"score text {digest(text)} generators {generators_digest()}")
        loss = score(self, text)
        note(self, f"loss {loss!r}")
        return loss

    def journaled_agree(self: Lockstep, *values: Any) -> Any:
        note(self, f"agree on {len(values)} value(s)")
        return agree(self, *values)

    return [
        (LanguageModelRun, "train_split", journaled_train_split),
        (LanguageModelRun, "score", journaled_score),
        (Lockstep, "agree", journaled_agree),
    ]


def journal(folder: Path, rank: int) -> list[str]:
    """The entries of ``folder/journal-RANK`` (none if the rank wrote none)."""
    path = folder / f"journal-{rank}"
    return path.read_text().splitlines() if path.exists() else []


def to_four_decimals(entry: str) -> str:
    """An entry with its loss as ``loss.txt`` gives it (4 decimals)."""
    return f"loss {float(entry[5:]):.4f}" if entry.startswith("loss ") else entry


def assert_journals_agree(folder: Path, ranks: int, reference: Path | None = None, whole: bool = False) -> None:
    """Every rank did what global rank 0 did (the same text, generators and losses), and what one process did
    (``reference``: a journal-0, losses to loss.txt's 4 decimals), at every entry both reached; ``whole``: the
    journals are complete (a run that ended), so they must be equal in full. A run that failed on every rank alike
    leaves journals that agree: its error is left to pass."""
    first = journal(folder, 0)
    for rank in range(1, ranks):
        other = journal(folder, rank)
        length = len(other) if whole else min(len(first), len(other))
        assert other[:length] == first[:length], f"rank {rank} parted from rank 0:\n{other}\nrank 0:\n{first}"
    if reference is not None:
        expected = [to_four_decimals(entry) for entry in journal(reference, 0)]
        for rank in range(ranks):
            seen = [to_four_decimals(entry) for entry in journal(folder, rank)]
            length = len(expected) if whole else min(len(seen), len(expected))
            assert seen[:length] == expected[:length], f"rank {rank} parted from one process:\n{seen}\n{expected}"


_WATCHED: list[tuple[str, Path]] = []
"""(folder, record): accesses of files under the folder are appended to the record (see :func:`file_accesses`)."""


def _note_file_access(event: str, arguments: tuple) -> None:
    if not _WATCHED or event not in ("open", "os.rename", "os.remove"):
        return
    if event == "open":
        if not isinstance(arguments[0], str | bytes | os.PathLike):
            return
        path, access = arguments[0], "write" if arguments[2] & (os.O_WRONLY | os.O_RDWR) else "read"
    else:
        path, access = arguments[1 if event == "os.rename" else 0], event[3:]
    path = os.path.abspath(os.fsdecode(path))
    for folder, record in _WATCHED:
        if path.startswith(folder + os.sep):
            initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if initialized else -1
            with open(record, "a") as stream:
                stream.write(f"{rank} {access} {os.path.relpath(path, folder)}\n")


_HOOKED: list[bool] = []


@contextmanager
def file_accesses(folder: Path, record: Path) -> Iterator[None]:
    """Within the block, every file this process (and the ranks it forks) opens, renames into place or removes under
    ``folder`` appends ``"RANK read|write|rename|remove PATH"`` to ``record`` (rank -1: before a process group;
    Python's audit events, so torch.load, logging's files and plain opens all count; torch.save's own writes do
    not, write_atomically's rename does)."""
    if not _HOOKED:
        sys.addaudithook(_note_file_access)  # for the rest of this process; idle outside the block
        _HOOKED.append(True)
    _WATCHED.append((os.path.abspath(folder), record))
    try:
        yield
    finally:
        _WATCHED.clear()


def accesses(record: Path) -> list[tuple[int, str, str]]:
    """The (rank, access, path) lines of a :func:`file_accesses` record."""
    if not record.exists():
        return []
    return [
        (int(rank), access, path)
        for rank, access, path in (line.split(" ", 2) for line in record.read_text().splitlines())
    ]


def journaled_dropout(model: LanguageModel, folder: Path) -> None:
    """Every dropout draw of ``model`` in training appends the digest of the generators it draws from to
    ``folder/journal-RANK`` (the model's ranks, forked, inherit the hook)."""
    folder.mkdir(parents=True, exist_ok=True)

    def note(module: torch.nn.Module, inputs: Any) -> None:
        if module.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            with open(folder / f"journal-{rank}", "a") as stream:
                stream.write(f"dropout generators {generators_digest()}\n")

    model.drop.register_forward_pre_hook(note)
