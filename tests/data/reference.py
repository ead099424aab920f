"""What the data tests compare: a data point described completely (tokens, whitespace, positions, head ids, every
label with its target, value and score, spans, document boundaries, metadata, the neighbours for use_context), and
small source files with the edge cases of flair's formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flair.data import DataPair, Sentence


def _layers(point: Any) -> list:
    return [
        (typename, [(label.data_point.unlabeled_identifier, label.value, label.score) for label in labels])
        for typename, labels in point.annotation_layers.items()
    ]


def describe(point: Any, context: bool = True) -> tuple:
    """Everything flair's reader gives a data point, in flair's order."""
    if isinstance(point, DataPair):
        return ("pair", describe(point.first, False), describe(point.second, False), _layers(point), len(point))
    assert isinstance(point, Sentence)
    tokens = [
        (token.text, token.whitespace_after, token.start_position, token.head_id, _layers(token)) for token in point
    ]
    spans = [
        (span.unlabeled_identifier, [(label.value, label.score) for label in span.labels]) for span in point.get_spans()
    ]
    neighbours = ()
    if context:
        previous, following = point.previous_sentence(), point.next_sentence()
        neighbours = (
            previous.to_original_text() if previous is not None else None,
            following.to_original_text() if following is not None else None,
        )
    return (
        tokens,
        point.start_position,
        point.to_original_text(),
        point.is_document_boundary,
        dict(point._metadata),
        _layers(point),
        spans,
        {typename: [label.value for label in point.get_labels(typename)] for typename in point.annotation_layers},
        neighbours,
    )


def describe_split(split: Any) -> list[tuple]:
    return [describe(split[index]) for index in range(len(split))]


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)
    return path


# token, POS (token-level), NER in BIO, chunks in BIOES; comments, document separators, blank-line runs, Unicode,
# a span at the end of each sentence, a line without the span columns (flair drops that sentence's spans).
COLUMNS = """\
# id = 1\tdomain=news
-DOCSTART- X O O

George NNP B-PER B-NP
Washington NNP I-PER E-NP
went VBD O S-VP
to O O O
Zürich NNP B-LOC S-NP



# a comment
Ελλάδα NNP B-LOC B-NP
und KON O I-NP
Ñandú NN B-ANIMAL E-NP
-DOCSTART- X O O
-DOCSTART- X O O

Tokyo NNP B-LOC B-NP
Tower NNP I-LOC E-NP
opened VBD
quickly RB O O
New NNP B-ORG B-NP
York NNP I-ORG I-NP
Times NNP I-ORG E-NP
"""
COLUMN_FORMAT = {0: "text", 1: "pos", 2: "ner", 3: "np"}

FASTTEXT = """\
__label__A __label__B Two labels on a line .
__label__B One label, some punctuation: yes!
no label here so flair skips it
__label__C
__label__A\tA tab after the label.
__label__C Ünïcödé text with émoji 🙂 and   spaces
__label__A __label__C __label__B three labels and a rather long sentence that truncation cuts short
"""

CSV = """\
text,label,other,pair
"The first, quoted text",pos,x,a second text
second text,neg,y,another one
,neg,z,empty first text
third text,,w,no label so skipped
fourth text,pos,v,"pair, with a comma"
"""
