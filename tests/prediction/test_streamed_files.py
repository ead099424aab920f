"""Streamed prediction from a file to a file, as docs/prediction.md describes it: the input formats, the output
formats (expected output written by hand), skipped records, chunks, the progress bar's default and a model whose
labels cannot move. One process unless the claim is about several."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
from flair.data import Label, Relation, Sentence
from flair.models import TextClassifier

import flair_fabric
from flair_fabric import cli
from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.launch.config import LaunchConfig
from flair_fabric.prediction import api as prediction_api
from flair_fabric.prediction.formats import Record, write_conll, write_jsonl
from flair_fabric.prediction.sharding import NotSplittable

from ..support import REPO, expect_success, small_trec, tiny_text_classifier

ONE = {"devices": 1, "accelerator": "cpu"}


@pytest.fixture(scope="module")
def classifier() -> TextClassifier:
    """An untrained tiny TREC classifier: it labels every sentence."""
    model = tiny_text_classifier(small_trec())
    model.eval()
    return model


@pytest.fixture(scope="module")
def saved_classifier(classifier: TextClassifier, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "classifier.pt"
    classifier.save(path)
    return path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- input ----------------------------------------------------------------------------------------------------------


def test_text_input_is_tokenized_with_segtok_by_default_and_split_on_spaces_without_a_tokenizer(
    classifier: TextClassifier, saved_classifier: Path, tmp_path: Path
) -> None:
    """``tokenizer=True`` (the default) tokenizes a line as flair's ``Sentence(line)`` does; ``tokenizer=False`` and
    the command line's ``--tokenizer space`` split it on spaces."""
    lines = ["Don't stop, Bob!", "Where's Bath?"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    segtok = [[token.text for token in Sentence(line)] for line in lines]
    spaces = [line.split() for line in lines]
    assert segtok != spaces, "the example tells the two apart"

    flair_fabric.predict(classifier, source, out_path=tmp_path / "default.jsonl", **ONE)
    assert [row["tokens"] for row in _rows(tmp_path / "default.jsonl")] == segtok
    flair_fabric.predict(classifier, source, out_path=tmp_path / "spaces.jsonl", tokenizer=False, **ONE)
    assert [row["tokens"] for row in _rows(tmp_path / "spaces.jsonl")] == spaces

    files = ["--model", str(saved_classifier), "--input", str(source), "--output", str(tmp_path / "cli.jsonl")]
    assert cli.main(["predict", *files, "--tokenizer", "space", "--devices", "1", "--accelerator", "cpu"]) == 0
    assert [row["tokens"] for row in _rows(tmp_path / "cli.jsonl")] == spaces
    assert [row["text"] for row in _rows(tmp_path / "cli.jsonl")] == lines


def test_conll_input_takes_the_first_column_of_space_or_tab_separated_lines_and_ignores_comments(
    classifier: TextClassifier, tmp_path: Path
) -> None:
    """Token first (whitespace or tabs between columns), blank lines end a sentence, ``# `` lines are comments (but
    ``#tag`` is a token)."""
    source = tmp_path / "in.conll"
    source.write_text(
        "# id = 1\nGeorge B-PER\nlives   O\n# a comment inside\n#tag\tO\n\n\n# id = 2\nBob\tB-PER\tx\n!\tO\n",
        encoding="utf-8",
    )
    summary = flair_fabric.predict(classifier, source, out_path=tmp_path / "out.jsonl", input_format="conll", **ONE)
    rows = _rows(tmp_path / "out.jsonl")
    assert [row["tokens"] for row in rows] == [["George", "lives", "#tag"], ["Bob", "!"]]
    assert (summary.read, summary.predicted, summary.skipped) == (2, 2, [])


def test_a_conll_sentence_with_a_line_that_is_not_utf8_is_skipped_and_listed(
    classifier: TextClassifier, tmp_path: Path
) -> None:
    """A CoNLL sentence (lines 4-6) with an undecodable line (5) is skipped whole and listed under its first line,
    naming the bad line; the sentences around it are predicted; read = predicted + skipped."""
    source = tmp_path / "in.conll"
    source.write_bytes(b"Hello\tO\nthere\tO\n\nWho\tO\n\xff\xfe\tO\n?\tO\n\nBye\tO\n")
    summary = flair_fabric.predict(classifier, source, out_path=tmp_path / "out.jsonl", input_format="conll", **ONE)
    assert summary.skipped == [(4, "line 5 is not UTF-8")]
    assert (summary.read, summary.predicted) == (3, 2)
    assert [(row["line"], row["tokens"]) for row in _rows(tmp_path / "out.jsonl")] == [
        (1, ["Hello", "there"]),
        (8, ["Bye"]),
    ]


def test_records_over_100000_characters_are_skipped_with_their_line_numbers(
    classifier: TextClassifier, tmp_path: Path
) -> None:
    """A text line of 100,002 characters (50,001 words) and a CoNLL sentence of one 100,001-character token are
    skipped and listed; a line of exactly 100,000 characters is predicted."""
    source = tmp_path / "in.txt"
    source.write_text("What is a cat ?\n" + "a " * 50_001 + "\n" + "x" * 100_000 + "\nWho ?\n", encoding="utf-8")
    summary = flair_fabric.predict(classifier, source, out_path=tmp_path / "out.jsonl", **ONE)
    assert summary.skipped == [(2, "longer than 100000 characters")]
    assert (summary.read, summary.predicted) == (4, 3)
    assert [row["line"] for row in _rows(tmp_path / "out.jsonl")] == [1, 3, 4]

    conll = tmp_path / "in.conll"
    conll.write_text("Hello\tO\n\n" + "y" * 100_001 + "\tO\n\nBye\tO\n", encoding="utf-8")
    summary = flair_fabric.predict(
        classifier, conll, out_path=tmp_path / "out2.jsonl", input_format="conll", progress_bar=False, **ONE
    )
    assert summary.skipped == [(3, "longer than 100000 characters")]
    assert [row["tokens"] for row in _rows(tmp_path / "out2.jsonl")] == [["Hello"], ["Bye"]]


# --- output ---------------------------------------------------------------------------------------------------------


def _labelled_sentence() -> Sentence:
    sentence = Sentence(["Ada", "Lovelace", "met", "Charles", "Babbage", "."])
    sentence.add_label("kind", "meeting", 0.75)
    sentence[2].add_label("pos", "VBD", 0.5)
    sentence[0:2].add_label("ner", "PER", 0.875)
    sentence[3:5].add_label("ner", "PER", 0.625)
    Relation(sentence[0:2], sentence[3:5]).add_label("rel", "met", 0.25)
    return sentence


def test_jsonl_output_holds_line_text_tokens_and_every_label_with_where_it_is() -> None:
    """One object per data point: line, text, tokens; labels with type, value, score and start/end (end exclusive)/
    text for spans, token (0-based) for token labels, head/tail for relations."""
    stream = io.StringIO()
    write_jsonl(stream, Record(7, _labelled_sentence()), ["kind", "pos", "ner", "rel"])
    ada = {"start": 0, "end": 2, "text": "Ada Lovelace"}
    charles = {"start": 3, "end": 5, "text": "Charles Babbage"}
    expected = {
        "line": 7,
        "text": "Ada Lovelace met Charles Babbage .",
        "tokens": ["Ada", "Lovelace", "met", "Charles", "Babbage", "."],
        "labels": [
            {"type": "kind", "value": "meeting", "score": 0.75},
            {"type": "pos", "value": "VBD", "score": 0.5, "token": 2, "text": "met"},
            {"type": "ner", "value": "PER", "score": 0.875, **ada},
            {"type": "ner", "value": "PER", "score": 0.625, **charles},
            {"type": "rel", "value": "met", "score": 0.25, "head": ada, "tail": charles},
        ],
    }
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1, "one line per data point"
    assert json.loads(text) == expected


def test_conll_output_is_the_input_columns_plus_a_bio_column_per_label_name_and_sentence_labels_as_comments() -> None:
    sentence = _labelled_sentence()
    columns = [[token.text, f"c{index}"] for index, token in enumerate(sentence)]
    stream = io.StringIO()
    write_conll(stream, Record(1, sentence, columns=columns), ["kind", "ner", "pos"])
    expected = (
        "# kind = meeting (0.7500)\n"
        "Ada\tc0\tO\tB-PER\tO\n"
        "Lovelace\tc1\tO\tI-PER\tO\n"
        "met\tc2\tO\tO\tVBD\n"
        "Charles\tc3\tO\tB-PER\tO\n"
        "Babbage\tc4\tO\tI-PER\tO\n"
        ".\tc5\tO\tO\tO\n"
        "\n"
    )
    assert stream.getvalue() == expected


def test_a_text_file_predicted_into_conll_or_jsonl_by_its_suffix(classifier: TextClassifier, tmp_path: Path) -> None:
    """Two sentences end to end, laid out as written by hand (labels: flair's predict in one process)."""
    source = tmp_path / "in.txt"
    source.write_text("What is a cat ?\nWho wrote Emma ?\n", encoding="utf-8")
    first, second = Sentence("What is a cat ?"), Sentence("Who wrote Emma ?")
    classifier.predict([first, second])
    one, two = first.get_label(TREC_LABEL_TYPE), second.get_label(TREC_LABEL_TYPE)
    flair_fabric.predict(classifier, source, out_path=tmp_path / "out.conll", **ONE)
    assert (tmp_path / "out.conll").read_text(encoding="utf-8") == (
        f"# {TREC_LABEL_TYPE} = {one.value} ({one.score:.4f})\nWhat\tO\nis\tO\na\tO\ncat\tO\n?\tO\n\n"
        f"# {TREC_LABEL_TYPE} = {two.value} ({two.score:.4f})\nWho\tO\nwrote\tO\nEmma\tO\n?\tO\n\n"
    )
    flair_fabric.predict(classifier, source, out_path=tmp_path / "out.tsv", **ONE)  # .tsv: CoNLL as well
    assert (tmp_path / "out.tsv").read_text(encoding="utf-8") == (tmp_path / "out.conll").read_text(encoding="utf-8")
    flair_fabric.predict(classifier, source, out_path=tmp_path / "out.jsonl", **ONE)
    assert _rows(tmp_path / "out.jsonl") == [
        {
            "line": 1,
            "text": "What is a cat ?",
            "tokens": ["What", "is", "a", "cat", "?"],
            "labels": [{"type": TREC_LABEL_TYPE, "value": one.value, "score": pytest.approx(one.score, abs=1e-6)}],
        },
        {
            "line": 2,
            "text": "Who wrote Emma ?",
            "tokens": ["Who", "wrote", "Emma", "?"],
            "labels": [{"type": TREC_LABEL_TYPE, "value": two.value, "score": pytest.approx(two.score, abs=1e-6)}],
        },
    ]


# --- skipped records, the summary, the progress bar -----------------------------------------------------------------


def test_the_command_line_lists_skipped_records_with_their_line_numbers_on_stderr(
    saved_classifier: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes(b"What is a cat ?\n\nWho wrote Emma ?\n\xff\xfe broken\n")
    files = ["--model", str(saved_classifier), "--input", str(source), "--output", str(tmp_path / "out.jsonl")]
    capsys.readouterr()
    assert cli.main(["predict", *files, "--devices", "1", "--accelerator", "cpu"]) == 0
    shown = capsys.readouterr()
    assert f"{source}:2: skipped (blank line)\n" in shown.err
    assert f"{source}:4: skipped (not UTF-8)\n" in shown.err
    assert "2 predicted, 2 skipped" in shown.out


def test_the_progress_bar_is_off_by_default_when_stderr_is_not_a_terminal_and_forced_by_true(
    classifier: TextClassifier, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Under capfd standard error is a file, not a terminal: ``progress_bar=None`` draws nothing, ``True`` a bar."""
    source = tmp_path / "in.txt"
    source.write_text("What is a cat ?\nWho wrote Emma ?\n", encoding="utf-8")
    assert not os.isatty(2)
    capfd.readouterr()
    flair_fabric.predict(classifier, source, out_path=tmp_path / "default.jsonl", **ONE)
    assert "predicting" not in capfd.readouterr().err
    flair_fabric.predict(classifier, source, out_path=tmp_path / "forced.jsonl", progress_bar=True, **ONE)
    assert "predicting: 2 data points" in capfd.readouterr().err


class _StandInRank:
    """What streamed prediction reads of one rank's Fabric: here a rank of a second machine, or global rank 0."""

    def __init__(self, global_rank: int, local_rank: int) -> None:
        self.global_rank, self.local_rank, self.world_size = global_rank, local_rank, 2
        self.is_global_zero = global_rank == 0


def test_the_streamed_bar_is_drawn_by_global_rank_zero_not_by_local_rank_zero_of_another_machine(
    classifier: TextClassifier, tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress_bar=True on global rank 1, local rank 0 (the first process of a second machine): no bar there; on
    global rank 0 the bar (the other ranks' work stood in for: nothing is predicted here)."""
    source = tmp_path / "in.txt"
    source.write_text("What is a cat ?\nWho wrote Emma ?\nWhere is Bath ?\n", encoding="utf-8")
    monkeypatch.setattr(prediction_api, "predict_across_ranks", lambda *args, **kwargs: None)
    stream = prediction_api._Stream(source, "text", tmp_path / "out.jsonl", "jsonl", True, 2, True)
    capfd.readouterr()
    prediction_api._predict_stream(_StandInRank(1, 0), classifier, stream, {})
    assert "predicting" not in capfd.readouterr().err
    prediction_api._predict_stream(_StandInRank(0, 0), classifier, stream, {})
    assert "predicting: 3 data points" in capfd.readouterr().err


_ON_A_TERMINAL = """
import sys
from flair.models import TextClassifier
import flair_fabric
model = TextClassifier.load(sys.argv[1])
for name, bar in (("default", None), ("off", False)):
    print(f"<<{name}>>", file=sys.stderr, flush=True)
    flair_fabric.predict(model, sys.argv[2], out_path=f"{sys.argv[3]}/{name}.jsonl", devices=1, accelerator="cpu",
                         progress_bar=bar)
    sys.stderr.flush()
print("<<end>>", file=sys.stderr, flush=True)
"""


def test_on_a_terminal_the_progress_bar_is_on_by_default_and_false_turns_it_off(
    saved_classifier: Path, tmp_path: Path
) -> None:
    """Standard error of a child process is a pseudo-terminal: ``progress_bar=None`` draws the bar there,
    ``progress_bar=False`` does not."""
    source = tmp_path / "in.txt"
    source.write_text("What is a cat ?\nWho wrote Emma ?\n", encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # tqdm draws to its width
    command = [sys.executable, "-c", _ON_A_TERMINAL, str(saved_classifier), str(source), str(tmp_path)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=terminal, cwd=REPO)
    os.close(terminal)
    shown = b""
    while True:
        try:
            piece = os.read(controller, 65536)
        except OSError:  # the child closed the terminal
            break
        if not piece:
            break
        shown += piece
    os.close(controller)
    expect_success(process.wait(timeout=300), "the script on a terminal", shown.decode(errors="replace"))
    text = shown.decode(errors="replace")
    assert "<<end>>" in text, text[-3000:]
    default, off = text.split("<<default>>")[1].split("<<off>>")
    assert "predicting: 2 data points" in default, default
    assert "predicting" not in off.split("<<end>>")[0], off


# --- a model whose labels cannot move -------------------------------------------------------------------------------


class _LabelsElsewhere(TextClassifier):
    """Also puts a label on a token of another sentence, for the sentence ``marked``: a label no other process can
    address."""

    marked = "Who wrote Emma ?"

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        returned = super().predict(sentences, *args, **kwargs)
        for sentence in sentences if isinstance(sentences, list) else [sentences]:
            if sentence.to_original_text() == self.marked:
                elsewhere = Label(Sentence("elsewhere")[0], "ELSEWHERE", 1.0)
                sentence.annotation_layers.setdefault(self.label_type, []).append(elsewhere)
        return returned


def test_a_file_with_a_model_whose_labels_cannot_move_stops_with_an_error_that_says_to_pass_data_points(
    tmp_path: Path,
) -> None:
    model = tiny_text_classifier(small_trec(), model_class=_LabelsElsewhere)
    model.eval()
    source = tmp_path / "in.txt"
    source.write_text(f"What is a cat ?\n{_LabelsElsewhere.marked}\nWhere is Bath ?\n", encoding="utf-8")
    with pytest.raises(NotSplittable, match="pass data points"):
        flair_fabric.predict(model, source, out_path=tmp_path / "out.jsonl", **ONE)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.txt"], "no output, not even a partial one"


# --- chunks ---------------------------------------------------------------------------------------------------------


class _BatchRecorder(TextClassifier):
    """Appends the size of every batch it encodes, with its process id, to the file ``record_to`` (set before the
    ranks fork)."""

    record_to: Path | None = None

    def _encode_data_points(self, sentences: Any, data_points: Any) -> Any:
        if self.record_to is not None:
            with self.record_to.open("a", encoding="utf-8") as stream:
                stream.write(json.dumps({"pid": os.getpid(), "size": len(sentences)}) + "\n")
        return super()._encode_data_points(sentences, data_points)


def _batch_sizes(path: Path) -> dict[int, list[int]]:
    """The recorded batch sizes of each process, in its order."""
    sizes: dict[int, list[int]] = {}
    for row in _rows(path):
        sizes.setdefault(row["pid"], []).append(row["size"])
    return sizes


def _recorder(record_to: Path) -> _BatchRecorder:
    model = tiny_text_classifier(small_trec(), model_class=_BatchRecorder)
    model.eval()
    _BatchRecorder.record_to = record_to
    return model


def _short_lines(path: Path, count: int) -> Path:
    path.write_text("".join(f"q{number} ?\n" for number in range(count)), encoding="utf-8")
    return path


def test_a_file_is_read_in_chunks_of_chunk_size_records_by_default_2048_on_one_process(tmp_path: Path) -> None:
    """With batches larger than any chunk, each chunk is one batch of flair's predict: its size is the chunk's."""
    model = _recorder(tmp_path / "explicit.jsonl")
    source = _short_lines(tmp_path / "in.txt", 2049)
    summary = flair_fabric.predict(
        model, source, out_path=tmp_path / "out.jsonl", chunk_size=900, mini_batch_size=10_000, **ONE
    )
    assert summary.predicted == 2049
    assert list(_batch_sizes(tmp_path / "explicit.jsonl").values()) == [[900, 900, 249]]
    _BatchRecorder.record_to = tmp_path / "default.jsonl"
    flair_fabric.predict(model, source, out_path=tmp_path / "out.jsonl", mini_batch_size=10_000, **ONE)
    assert list(_batch_sizes(tmp_path / "default.jsonl").values()) == [[2048, 1]], "default: 2048 x 1 process"


def test_the_default_chunk_counts_every_process_of_every_node(tmp_path: Path) -> None:
    """2048 records per process: 2 devices on each of 3 nodes read chunks of 12,288 (checked before any process)."""
    source = _short_lines(tmp_path / "in.txt", 3)
    config = LaunchConfig("cpu", 2, 3, "ddp", "32-true")
    stream = prediction_api._checked_stream(source, "text", tmp_path / "out.jsonl", None, True, None, config, False)
    assert stream.chunk_size == 2048 * 2 * 3


@pytest.mark.multiprocess
def test_the_default_chunk_on_2_ranks_is_4096_records(tmp_path: Path) -> None:
    """2 forked ranks, 4097 lines, batches larger than any chunk: the first chunk (4096 records) is one batch, the
    second (1 record) another."""
    model = _recorder(tmp_path / "batches.jsonl")
    source = _short_lines(tmp_path / "in.txt", 4097)
    summary = flair_fabric.predict(
        model,
        source,
        out_path=tmp_path / "out.jsonl",
        mini_batch_size=10_000,
        devices=2,
        accelerator="cpu",
        strategy="ddp_fork",
    )
    assert summary.predicted == 4097
    sizes = _batch_sizes(tmp_path / "batches.jsonl")
    assert sorted(size for each in sizes.values() for size in each) == [1, 4096], sizes
