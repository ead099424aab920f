"""``ddp_spawn`` sends what its workers need through ``flair_fabric.launch.transport``: a flair ``ColumnCorpus`` of any
size arrives whole, every sentence still linked to its neighbours (``_previous_sentence``/``_next_sentence``, which
``use_context`` reads), with its tokens, labels and spans. Plain pickling follows those links one level of recursion
per sentence and fails at a few hundred sentences."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import flair
import pytest
from flair.data import Corpus, Sentence
from flair.datasets import ColumnCorpus
from flair.embeddings import TransformerWordEmbeddings
from flair.models import SequenceTagger
from flair.trainers import ModelTrainer

from flair_fabric import FabricTrainer, FlairFSDPStrategy, evaluate, predict
from flair_fabric.datasets import WNUT16_FILE, WNUT16_LABEL_TYPE
from flair_fabric.launch import transport
from flair_fabric.launch.config import make_launch_config

from ..support import make_tiny_bert, run_on_ranks, state_dict_difference

LINKED = 20_000
SPAWNED = 3_000
CONTEXT = 4  # tokens of context on each side, as use_context=4 reads them


LINKED_OPTIONS: dict[str, Any] = {
    "column_delimiter": "\t",
    "comment_symbol": "# ",
    "document_separator_token": "-DOCSTART-",
    "sample_missing_splits": False,
}


def write_linked_column_files(folder: Path, sentences: int) -> None:
    """WNUT-16 tweets repeated to ``sentences`` training sentences in documents of 50 (``-DOCSTART-`` lines between
    them) with a comment line before each tweet, as column files; dev and test: 40 tweets each."""
    tweets = [block.strip("\n") for block in WNUT16_FILE.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    folder.mkdir(parents=True, exist_ok=True)

    def write(name: str, count: int, offset: int) -> None:
        blocks = []
        for number in range(count):
            if number % 50 == 0:
                blocks.append("-DOCSTART-\tO")
            blocks.append(f"# tweet {number}\n{tweets[(offset + number) % len(tweets)]}")
        (folder / name).write_text("\n\n".join(blocks) + "\n\n", encoding="utf-8")

    write("train.txt", sentences, 0)
    write("dev.txt", 40, 7)
    write("test.txt", 40, 99)


def linked_column_corpus(folder: Path, sentences: int) -> ColumnCorpus:
    """:func:`write_linked_column_files`, read by flair's own ColumnCorpus."""
    write_linked_column_files(folder, sentences)
    return ColumnCorpus(folder, {0: "text", 1: WNUT16_LABEL_TYPE}, **LINKED_OPTIONS)


def _where(neighbour: Sentence | None, position: dict[int, int]) -> int:
    return -1 if neighbour is None else position.get(id(neighbour), -2)


def _neighbours_and_context(sentence: Sentence, position: dict[int, int]) -> list[Any]:
    """Where the sentence's neighbours are and the context use_context reads; ``"unlinked"`` where the sentence has no
    link attributes at all (flair's reader always sets them)."""
    if not all(hasattr(sentence, name) for name in ("_previous_sentence", "_next_sentence")):
        return ["unlinked"] * 4
    return [
        _where(sentence._previous_sentence, position),
        _where(sentence._next_sentence, position),
        [token.text for token in sentence.left_context(CONTEXT)],
        [token.text for token in sentence.right_context(CONTEXT)],
    ]


def linked_view(corpus: Corpus) -> list[list[Any]]:
    """Each sentence of each split: its tagged text, its spans, whether it is a document boundary, the positions of its
    neighbours in its split (-1: none, -2: an object outside the split) and the context use_context reads."""
    rows = []
    for split in (corpus.train, corpus.dev, corpus.test):
        sentences: list[Sentence] = [split[index] for index in range(len(split))]
        position = {id(sentence): index for index, sentence in enumerate(sentences)}
        for sentence in sentences:
            rows.append(
                [
                    sentence.to_tagged_string(),
                    [(span.unlabeled_identifier, span.tag) for span in sentence.get_spans(WNUT16_LABEL_TYPE)],
                    sentence.is_document_boundary,
                    *_neighbours_and_context(sentence, position),
                ]
            )
    return rows


@pytest.fixture(scope="module")
def linked_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[ColumnCorpus, list[list[Any]]]:
    corpus = linked_column_corpus(tmp_path_factory.mktemp("linked"), LINKED)
    return corpus, linked_view(corpus)


def test_plain_pickling_fails_on_a_linked_corpus(linked_corpus: tuple[ColumnCorpus, list[list[Any]]]) -> None:
    """The reference: what the transport exists for (flair's own objects, pickled as they are)."""
    corpus, _ = linked_corpus
    with pytest.raises(RecursionError):
        pickle.dumps(corpus.train)


def test_a_linked_corpus_of_20000_sentences_crosses_whole(linked_corpus: tuple[ColumnCorpus, list[list[Any]]]) -> None:
    corpus, view = linked_corpus
    assert len(corpus.train) == LINKED + LINKED // 50, "the tweets and one -DOCSTART- sentence per 50"
    try:
        crossed = transport.loads(transport.dumps(corpus))
    except RecursionError:
        pytest.fail("the transport follows the sentence links as plain pickling does")
    except pickle.UnpicklingError as error:
        pytest.fail(f"what the transport wrote does not read back: {error}")
    assert crossed is not corpus
    assert linked_view(crossed) == view
    middle = [crossed.train[index] for index in (1, 2, 3)]
    assert getattr(middle[1], "_previous_sentence", None) is middle[0]
    assert getattr(middle[1], "_next_sentence", None) is middle[2]


def _write_linked_view(fabric: Any, argument: tuple[ColumnCorpus, Path]) -> None:
    corpus, out = argument
    (out / f"view-rank{fabric.global_rank}.json").write_text(json.dumps(linked_view(corpus)), encoding="utf-8")


def _fsdp_spawn() -> FlairFSDPStrategy:
    return FlairFSDPStrategy(start_method="spawn")


@pytest.fixture(scope="module")
def spawned_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[ColumnCorpus, list[list[Any]]]:
    """A linked corpus too long for plain pickling, small enough for workers to compare it quickly."""
    corpus = linked_column_corpus(tmp_path_factory.mktemp("spawned"), SPAWNED)
    return corpus, linked_view(corpus)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_spawn", _fsdp_spawn], ids=["ddp_spawn", "fsdp-spawn"])
def test_spawned_workers_receive_a_linked_corpus_of_3000_sentences_whole(
    spawned_corpus: tuple[ColumnCorpus, list[list[Any]]], tmp_path: Path, strategy: Any
) -> None:
    """Both spawn starts (DDP's and FSDP's) hand the corpus, which plain pickling cannot send, to their workers
    through the transport."""
    corpus, view = spawned_corpus
    with pytest.raises(RecursionError):
        pickle.dumps(corpus.train)
    strategy = strategy if isinstance(strategy, str) else strategy()
    config = make_launch_config(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, precision=None)
    run_on_ranks(config, _write_linked_view, (corpus, tmp_path))
    expected = json.loads(json.dumps(view))  # tuples as JSON gives them back
    for rank in (0, 1):
        assert json.loads((tmp_path / f"view-rank{rank}.json").read_text(encoding="utf-8")) == expected, rank


def _context_tagger(corpus: Corpus, bert: Path) -> SequenceTagger:
    flair.set_seed(7)
    embeddings = TransformerWordEmbeddings(str(bert), fine_tune=True, use_context=CONTEXT, context_dropout=0.0)
    tags = corpus.make_label_dictionary(WNUT16_LABEL_TYPE, add_unk=False)
    return SequenceTagger(
        embeddings=embeddings,
        tag_dictionary=tags,
        tag_type=WNUT16_LABEL_TYPE,
        use_rnn=False,
        use_crf=False,
        dropout=0.0,
        word_dropout=0.0,
        locked_dropout=0.0,
    )


@pytest.mark.multiprocess
def test_use_context_trains_under_spawn_as_flair_trains_on_the_union(tmp_path: Path) -> None:
    """600 linked sentences (more than plain pickling could send): a tagger whose transformer reads 4 tokens of
    context on each side, trained on 2 spawned ranks, ends with the weights of flair's one-process training on the
    union of the batches. Without the links in the workers, each rank would embed its sentences without context."""
    corpus = linked_column_corpus(tmp_path / "corpus", 600)
    bert = make_tiny_bert(tmp_path / "bert", corpus, max_positions=128)
    settings = {"max_epochs": 1, "learning_rate": 0.05, "shuffle": False, "use_final_model_for_eval": True}
    reference = _context_tagger(corpus, bert)
    ModelTrainer(reference, corpus).train(tmp_path / "flair", mini_batch_size=32, **settings)
    model = _context_tagger(corpus, bert)
    FabricTrainer(model, corpus).train(
        tmp_path / "spawn", mini_batch_size=16, accelerator="cpu", devices=2, strategy="ddp_spawn", **settings
    )
    assert state_dict_difference(model.state_dict(), reference.state_dict()) <= 1e-5
    without_context = _context_tagger(corpus, bert)
    without_context.embeddings.context_length = 0
    ModelTrainer(without_context, corpus).train(tmp_path / "no-context", mini_batch_size=32, **settings)
    assert state_dict_difference(without_context.state_dict(), reference.state_dict()) > 1e-3, "context mattered"


def _tagged(sentences: list[Sentence]) -> list[list[tuple[str, str]]]:
    """The predicted labels of each sentence: what they label (a span or a token) and their value."""
    return [
        [(label.data_point.unlabeled_identifier, label.value) for label in sentence.get_labels("predicted")]
        for sentence in sentences
    ]


@pytest.mark.multiprocess
def test_evaluate_and_predict_under_spawn_read_a_linked_split_with_its_context(tmp_path: Path) -> None:
    """``evaluate`` and ``predict`` with spawned workers on 600 linked sentences (more than plain pickling could send):
    flair's own ``evaluate`` and ``predict`` in this process, with the same context, are the reference. The tagger
    is untrained, so its tags follow every token it reads: without the links the workers would read no context."""
    corpus = linked_column_corpus(tmp_path / "corpus", 600)
    bert = make_tiny_bert(tmp_path / "bert", corpus, max_positions=128)
    model = _context_tagger(corpus, bert)
    split = [corpus.train[index] for index in range(len(corpus.train))]
    spawned = {"accelerator": "cpu", "devices": 2, "strategy": "ddp_spawn"}

    reference = model.evaluate(corpus.train, WNUT16_LABEL_TYPE, mini_batch_size=32)
    result = evaluate(model, corpus.train, WNUT16_LABEL_TYPE, mini_batch_size=32, **spawned)
    assert result.detailed_results == reference.detailed_results
    assert result.loss == pytest.approx(reference.loss, rel=1e-6)

    model.predict(split, mini_batch_size=32, label_name="predicted")
    expected = _tagged(split)
    for sentence in split:
        sentence.remove_labels("predicted")
    predict(model, split, mini_batch_size=32, label_name="predicted", **spawned)
    assert _tagged(split) == expected

    model.embeddings.context_length = 0
    model.predict(split, mini_batch_size=32, label_name="predicted")
    assert _tagged(split) != expected, "the context changes the tags"
