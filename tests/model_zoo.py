"""A zoo of tiny, fast, deterministic flair models, each with a tiny in-memory corpus.

``ZOO`` maps a short name to a builder ``builder(folder) -> (model, corpus, extra_train_kwargs)``:

* ``folder`` is a work folder for files a builder must write (a tiny random BERT for the TARS models);
* ``extra_train_kwargs`` holds the flair ``train`` arguments a model needs (``plugins=[DeepNCMPlugin()]`` for the
  DeepNCM decoder). They are fresh objects on every call: flair's ``ModelTrainer.train`` appends its own
  ``AnnealingPlugin`` to the ``plugins`` list it is given, so never pass one such dict to two trainings.

Every builder calls ``flair.set_seed(seed)`` first, so two calls give identical initial weights. No model has dropout.

Data layout: for ``relation_extractor``, ``span`` and ``text_missing_labels`` the train split alternates a data point
with something to learn (even index) and one without (odd index). Cut for 2 ranks by strided sharding (rank r takes
points r, r+2, ...) into batches of 2, every batch of rank 1 has nothing to learn: ``DefaultClassifier.forward_loss``
returns its constant ``torch.tensor(0.0, requires_grad=True)`` (no ``grad_fn``); see ``learns_nothing``.
(The odd-indexed points: relation sentences with fewer than two entities, linking sentences without a mention, and
TREC questions without a label for ``PartiallyLabelledTextClassifier``; flair's own TextClassifier raises on those.)

Run the self-check with ``python -m tests.model_zoo [epochs] [names...]`` from the repository root.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import flair
import torch
from flair.data import Corpus, DataPair, DataPoint, DataTriple, Dictionary, Relation, Sentence, TextPair, TextTriple
from flair.datasets import FlairDatapointDataset
from flair.embeddings import (
    DocumentPoolEmbeddings,
    OneHotEmbeddings,
    TransformerDocumentEmbeddings,
    TransformerWordEmbeddings,
)
from flair.models import (
    Lemmatizer,
    RelationClassifier,
    RelationExtractor,
    SequenceTagger,
    SpanClassifier,
    TARSClassifier,
    TARSTagger,
    TextClassifier,
    TextPairClassifier,
    TextRegressor,
    TextTripleClassifier,
    TokenClassifier,
)
from flair.nn import DeepNCMDecoder, Model, PrototypicalDecoder
from flair.nn.multitask import make_multitask_model_and_corpus
from flair.trainers.plugins import DeepNCMPlugin

from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus
from tests.support import make_tiny_bert

SEED = 7
DIM = 16  # one-hot embedding size and RNN hidden size

Built = tuple[Model, Corpus, dict[str, Any]]
Builder = Callable[[Path], Built]

# ---------------------------------------------------------------------------------------------------------------------
# data: small handwritten sentences (entities are written ``[words]LABEL``) and a few TREC questions
# ---------------------------------------------------------------------------------------------------------------------

# named entities (label type "ner"): 12 train, 3 dev, 3 test
NER = (
    [
        "[Ada Lovelace]PER was born in [London]LOC .",
        "[Google]ORG opened an office in [Berlin]LOC .",
        "[Grace Hopper]PER worked for the [US Navy]ORG .",
        "The weather in [Paris]LOC is mild .",
        "[Linus Torvalds]PER lives in [Portland]LOC .",
        "[Siemens]ORG builds trains in [Munich]LOC .",
        "[Alan Turing]PER studied in [Cambridge]LOC .",
        "Nobody called [Marie]PER yesterday .",
        "[Apple]ORG hired [Tim Cook]PER .",
        "We met [Bob]PER at [IBM]ORG .",
        "[Berlin]LOC and [Paris]LOC are big cities .",
        "It rained all day .",
    ],
    [
        "[Marie Curie]PER moved to [Paris]LOC .",
        "[IBM]ORG is based in [New York]LOC .",
        "[Tim]PER visited [Google]ORG .",
    ],
    [
        "[Ada]PER works for [Siemens]ORG .",
        "[Alan]PER flew to [Berlin]LOC .",
        "[Apple]ORG sells phones in [London]LOC .",
    ],
)

# relations between the "ner" entities (label type "relation", (head entity, tail entity, relation)):
# even-indexed train sentences have two entities and a relation, odd-indexed ones fewer than two entities
RELATIONS = (
    [
        ("[Ada Lovelace]PER was born in [London]LOC .", [(0, 1, "born_in")]),
        ("[Paris]LOC is lovely in spring .", []),
        ("[Linus Torvalds]PER founded [Linux]ORG .", [(0, 1, "founded")]),
        ("It rained all day .", []),
        ("[Grace Hopper]PER works for [IBM]ORG .", [(0, 1, "works_for")]),
        ("[Siemens]ORG sells trains .", []),
        ("[Tim]PER was born in [Berlin]LOC .", [(0, 1, "born_in")]),
        ("Nobody came to the party .", []),
        ("[Marie]PER founded [Acme]ORG .", [(0, 1, "founded")]),
        ("[Alan Turing]PER liked long walks .", []),
        ("[Bob]PER works for [Google]ORG .", [(0, 1, "works_for")]),
        ("The train was late again .", []),
    ],
    [
        # the odd-indexed dev sentences have no entity pair either: evaluated one per batch on 2 ranks, rank 1 has
        # nothing to predict
        ("[Marie Curie]PER was born in [Warsaw]LOC .", [(0, 1, "born_in")]),
        ("It rained in [Paris]LOC .", []),
        ("[Bob]PER founded [Apple]ORG .", [(0, 1, "founded")]),
    ],
    [
        ("[Alan]PER was born in [London]LOC .", [(0, 1, "born_in")]),
        ("[Grace]PER founded [Google]ORG .", [(0, 1, "founded")]),
        ("[Linus]PER works for [IBM]ORG .", [(0, 1, "works_for")]),
    ],
)

# entity linking (label type "nel"): even-indexed train sentences have linked mentions, odd-indexed ones none
LINKS = (
    [
        "I flew to [Paris]Paris_city last year .",
        "The weather was fine .",
        "[Apple]Apple_Inc released a new phone .",
        "We ate lunch outside .",
        "She ate an [apple]apple_fruit for lunch .",
        "Nothing happened today .",
        "[Berlin]Berlin_city is the capital of [Germany]Germany .",
        "He read a book .",
        "[Paris Hilton]Paris_Hilton visited [Berlin]Berlin_city .",
        "They went home early .",
        "[Apple]Apple_Inc opened a store in [Paris]Paris_city .",
        "It was a quiet evening .",
    ],
    ["[Apple]Apple_Inc is based in [Germany]Germany .", "He ate an [apple]apple_fruit ."],
    ["[Paris Hilton]Paris_Hilton flew to [Paris]Paris_city .", "[Berlin]Berlin_city has an [Apple]Apple_Inc store ."],
)

# topics (label type "topic", multi-label)
TOPICS = (
    [
        ("The team won the final match .", ["sports"]),
        ("Parliament passed a new budget .", ["politics"]),
        ("The new phone has a fast chip .", ["tech"]),
        ("The minister opened a football stadium .", ["politics", "sports"]),
        ("Players now track games with an app .", ["sports", "tech"]),
        ("The government funds new chip factories .", ["politics", "tech"]),
        ("Fans cheered as the team scored .", ["sports"]),
        ("Voters elected a new mayor .", ["politics"]),
        ("Engineers released a software update .", ["tech"]),
        ("The senator talked about online privacy .", ["politics", "tech"]),
        ("The coach bought a smart watch .", ["sports", "tech"]),
        ("The mayor ran a marathon .", ["politics", "sports"]),
    ],
    [("The team bought new software .", ["sports", "tech"]), ("The president gave a speech .", ["politics"])],
    [("The minister praised the new app .", ["politics", "tech"]), ("The runner won gold .", ["sports"])],
)

# reviews with a star rating (label types "sentiment" and "score")
REVIEWS = (
    [
        ("I loved this movie .", 5.0),
        ("What a terrible film .", 1.0),
        ("The plot was great fun .", 4.0),
        ("Boring and far too long .", 2.0),
        ("A wonderful cast and a great story .", 5.0),
        ("I hated every minute .", 1.0),
        ("Nice music and good actors .", 4.0),
        ("The ending was awful .", 2.0),
        ("Great film , I loved it .", 5.0),
        ("Too long and rather boring .", 2.0),
        ("A fun story with good music .", 4.0),
        ("Terrible actors and an awful plot .", 1.0),
    ],
    [("A great cast .", 5.0), ("An awful story .", 1.0)],
    [("I loved the music .", 4.0), ("Boring and terrible .", 1.0)],
)

# words with their lemmas (label type "lemma"), written ``word/lemma``
LEMMAS = (
    [
        "The/the cats/cat were/be sleeping/sleep ./.",
        "A/a dog/dog barks/bark loudly/loudly ./.",
        "She/she walked/walk two/two miles/mile ./.",
        "They/they are/be eating/eat apples/apple ./.",
        "He/he has/have three/three books/book ./.",
        "The/the children/child played/play outside/outside ./.",
        "We/we saw/see many/many birds/bird ./.",
        "The/the mice/mouse ran/run away/away ./.",
        "I/i am/be reading/read stories/story ./.",
        "Dogs/dog were/be chasing/chase cars/car ./.",
        "She/she buys/buy fresh/fresh eggs/egg ./.",
        "The/the men/man carried/carry boxes/box ./.",
    ],
    ["The/the women/woman were/be singing/sing ./.", "He/he ate/eat two/two apples/apple ./."],
    ["The/the birds/bird are/be flying/fly ./.", "We/we walked/walk home/home ./."],
)

# who lives where: (person, city the first text names, city the second text names)
RESIDENTS = (
    [
        ("Ada", "Paris", "Paris"),
        ("Alan", "London", "Berlin"),
        ("Grace", "Berlin", "Berlin"),
        ("Linus", "Paris", "London"),
        ("Marie", "London", "London"),
        ("Tim", "Berlin", "Paris"),
        ("Bob", "Paris", "Paris"),
        ("Ada", "London", "Paris"),
        ("Alan", "Berlin", "Berlin"),
        ("Grace", "Paris", "London"),
        ("Linus", "London", "London"),
        ("Marie", "Berlin", "Paris"),
    ],
    [("Tim", "London", "London"), ("Bob", "Berlin", "Paris")],
    [("Ada", "Berlin", "Berlin"), ("Alan", "Paris", "London")],
)

_MARKED = re.compile(r"\[([^\]]+)\]([\w-]+)|(\S+)")


def marked(text: str, label_type: str = "ner") -> Sentence:
    """A sentence from ``text`` whose ``[words]LABEL`` parts become spans labelled ``LABEL`` (type ``label_type``)."""
    tokens: list[str] = []
    spans: list[tuple[int, int, str]] = []
    for match in _MARKED.finditer(text):
        if match.group(3) is not None:
            tokens.append(match.group(3))
            continue
        words = match.group(1).split()
        spans.append((len(tokens), len(tokens) + len(words), match.group(2)))
        tokens.extend(words)
    sentence = Sentence(tokens)
    for start, end, value in spans:
        sentence[start:end].add_label(label_type, value)
    return sentence


def labelled(text: str, label_type: str, values: Iterable[str]) -> Sentence:
    """A space-tokenised sentence with one sentence label of ``label_type`` for each of ``values``."""
    sentence = Sentence(text.split())
    for value in values:
        sentence.add_label(label_type, value)
    return sentence


def related(text: str, relations: Sequence[tuple[int, int, str]]) -> Sentence:
    """A ``marked`` sentence with relations (label type ``relation``) between its i-th and j-th entities."""
    sentence = marked(text)
    spans = sentence.get_spans("ner")
    for head, tail, value in relations:
        Relation(spans[head], spans[tail]).add_label("relation", value)
    return sentence


def lemmatised(text: str) -> Sentence:
    """A sentence from ``word/lemma`` tokens, each token labelled with its lemma (label type ``lemma``)."""
    pairs = [token.rsplit("/", 1) for token in text.split()]
    sentence = Sentence([word for word, _ in pairs])
    for token, (_, lemma) in zip(sentence, pairs, strict=True):
        token.add_label("lemma", lemma)
    return sentence


def make_corpus(splits: tuple[Sequence[Any], Sequence[Any], Sequence[Any]], name: str) -> Corpus:
    """An in-memory corpus of the three given splits (train, dev, test), nothing sampled."""
    train, dev, test = (FlairDatapointDataset(list(split)) for split in splits)
    return Corpus(train, dev, test, name=name, sample_missing_splits=False)


def split_map(splits: tuple[Sequence[Any], ...], make: Callable[[Any], Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """Apply ``make`` to every item of the three splits."""
    train, dev, test = ([make(item) for item in split] for split in splits)
    return train, dev, test


def ner_corpus() -> Corpus:
    """Named entities (``ner``: PER, ORG, LOC spans)."""
    return make_corpus(split_map(NER, marked), "tiny-ner")


def relation_corpus() -> Corpus:
    """Entities (``ner``) and relations (``relation``); odd-indexed train sentences have fewer than two entities."""
    return make_corpus(split_map(RELATIONS, lambda item: related(*item)), "tiny-relations")


def trec(train_size: int = 12, dev_size: int = 3, test_size: int = 3) -> Corpus:
    """A few TREC questions (``question_class``) from the repository's data."""
    return trec_corpus(train_size=train_size, dev_size=dev_size, test_size=test_size, seed=3)


def points_of(corpus: Corpus) -> list[DataPoint]:
    """All data points of a corpus: train, dev, then test."""
    return [point for split in (corpus.train, corpus.dev, corpus.test) if split is not None for point in split]


def sentences_in(points: Iterable[DataPoint]) -> list[Sentence]:
    """The sentences in data points (the parts of a pair or triple)."""
    sentences: list[Sentence] = []
    for point in points:
        if isinstance(point, DataTriple):
            sentences.extend([point.first, point.second, point.third])
        elif isinstance(point, DataPair):
            sentences.extend([point.first, point.second])
        else:
            sentences.append(point)
    return sentences


def one_hot(points: Iterable[DataPoint], dim: int = DIM) -> OneHotEmbeddings:
    """Trainable one-hot word embeddings over the words of ``points`` (sorted, so the same every time)."""
    vocabulary = Dictionary()  # with <unk>
    for word in sorted({token.text for sentence in sentences_in(points) for token in sentence}):
        vocabulary.add_item(word)
    return OneHotEmbeddings(vocabulary, embedding_length=dim)


def pooled(words: OneHotEmbeddings) -> DocumentPoolEmbeddings:
    """Mean-pooled document embeddings with a trainable nonlinear layer."""
    return DocumentPoolEmbeddings([words], fine_tune_mode="nonlinear")


def tiny_bert(folder: Path, points: Iterable[DataPoint], extra_words: Iterable[str] = ()) -> Path:
    """``tests.support.make_tiny_bert`` over the words of ``points`` and ``extra_words`` (e.g. TARS label names)."""
    sentences = sentences_in(points) + [Sentence(word.split()) for word in extra_words]
    vocabulary = Corpus(FlairDatapointDataset(sentences), None, None, sample_missing_splits=False)
    return make_tiny_bert(Path(folder) / "tiny-bert", vocabulary)


NO_DROPOUT = {"dropout": 0.0, "word_dropout": 0.0, "locked_dropout": 0.0}


class PartiallyLabelledTextClassifier(TextClassifier):
    """A TextClassifier that trains only on the sentences of a batch that carry a label of its label type.

    flair's own TextClassifier cannot skip an unlabelled sentence: ``DefaultClassifier._prepare_label_tensor``
    gives it the label ``"O"`` (an ``IndexError`` when ``"O"`` is not in the label dictionary, else a real target).
    Here a batch without labels reaches ``DefaultClassifier.forward_loss`` empty and takes its
    ``len(data_points) == 0`` branch. Prediction and evaluation are TextClassifier's.
    """

    def forward_loss(self, sentences: list[Sentence]) -> tuple[torch.Tensor, int]:
        labelled_sentences = [sentence for sentence in sentences if sentence.get_labels(self.label_type)]
        return super().forward_loss(labelled_sentences)


# ---------------------------------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------------------------------


def build_text(folder: Path, seed: int = SEED) -> Built:
    """TextClassifier, single-label, on TREC questions."""
    flair.set_seed(seed)
    corpus = trec()
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = TextClassifier(pooled(one_hot(corpus.train)), label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    return model, corpus, {}


def build_text_missing_labels(folder: Path, seed: int = SEED) -> Built:
    """Single-label text classifier on TREC questions whose odd-indexed train questions have no label."""
    flair.set_seed(seed)
    corpus = trec()
    for index, sentence in enumerate(corpus.train):
        if index % 2 == 1:
            sentence.remove_labels(TREC_LABEL_TYPE)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = PartiallyLabelledTextClassifier(
        pooled(one_hot(corpus.train)), label_type=TREC_LABEL_TYPE, label_dictionary=labels
    )
    return model, corpus, {}


def build_multi_label(folder: Path, seed: int = SEED) -> Built:
    """TextClassifier, multi-label (``multi_label=True``), on topics."""
    flair.set_seed(seed)
    corpus = make_corpus(split_map(TOPICS, lambda item: labelled(item[0], "topic", item[1])), "tiny-topics")
    labels = corpus.make_label_dictionary("topic", add_unk=False)
    model = TextClassifier(pooled(one_hot(corpus.train)), label_type="topic", label_dictionary=labels, multi_label=True)
    return model, corpus, {}


def build_regressor(folder: Path, seed: int = SEED) -> Built:
    """TextRegressor on review star ratings (label ``score``)."""
    flair.set_seed(seed)
    corpus = make_corpus(split_map(REVIEWS, lambda item: labelled(item[0], "score", [str(item[1])])), "tiny-scores")
    return TextRegressor(pooled(one_hot(corpus.train)), label_name="score"), corpus, {}


def resident_texts(person: str, city: str, other_city: str) -> tuple[Sentence, Sentence, str]:
    """Two sentences saying where ``person`` lives and whether they agree."""
    first = Sentence(f"{person} lives in {city} .".split())
    second = Sentence(f"{person} is a resident of {other_city} .".split())
    return first, second, "yes" if city == other_city else "no"


def build_pair(folder: Path, seed: int = SEED) -> Built:
    """TextPairClassifier (embedding the concatenated pair): do two sentences agree on where someone lives?"""
    flair.set_seed(seed)

    def pair(item: tuple[str, str, str]) -> TextPair:
        first, second, value = resident_texts(*item)
        point = TextPair(first, second)
        point.add_label("agree", value)
        return point

    corpus = make_corpus(split_map(RESIDENTS, pair), "tiny-pairs")
    labels = corpus.make_label_dictionary("agree", add_unk=False)
    model = TextPairClassifier(
        pooled(one_hot(corpus.train)), label_type="agree", label_dictionary=labels, embed_separately=False
    )
    return model, corpus, {}


def build_triple(folder: Path, seed: int = SEED) -> Built:
    """TextTripleClassifier (embedding each text separately): does an answer fit a question and its context?"""
    flair.set_seed(seed)

    def triple(item: tuple[str, str, str]) -> TextTriple:
        person, city, other_city = item
        context = Sentence(f"{person} lives in {city} .".split())
        question = Sentence(f"Where does {person} live ?".split())
        answer = Sentence(f"In {other_city} .".split())
        point = TextTriple(question, answer, context)
        point.add_label("answer", "correct" if city == other_city else "wrong")
        return point

    corpus = make_corpus(split_map(RESIDENTS, triple), "tiny-triples")
    labels = corpus.make_label_dictionary("answer", add_unk=False)
    model = TextTripleClassifier(
        pooled(one_hot(corpus.train)), label_type="answer", label_dictionary=labels, embed_separately=True
    )
    return model, corpus, {}


def _tagger(use_crf: bool, tag_format: str, seed: int) -> Built:
    flair.set_seed(seed)
    corpus = ner_corpus()
    tags = corpus.make_label_dictionary("ner", add_unk=False)
    model = SequenceTagger(
        embeddings=one_hot(corpus.train),
        tag_dictionary=tags,
        tag_type="ner",
        tag_format=tag_format,
        hidden_size=DIM,
        use_crf=use_crf,
        **NO_DROPOUT,
    )
    return model, corpus, {}


def build_tagger_crf(folder: Path, seed: int = SEED) -> Built:
    """SequenceTagger, BiLSTM-CRF, BIO-encoded NER spans."""
    return _tagger(use_crf=True, tag_format="BIO", seed=seed)


def build_tagger(folder: Path, seed: int = SEED) -> Built:
    """SequenceTagger, BiLSTM without CRF, BIOES-encoded NER spans."""
    return _tagger(use_crf=False, tag_format="BIOES", seed=seed)


def build_token(folder: Path, seed: int = SEED) -> Built:
    """TokenClassifier (a linear layer over word embeddings), BIO-encoded NER spans."""
    flair.set_seed(seed)
    corpus = ner_corpus()
    labels = corpus.make_label_dictionary("ner", add_unk=False)
    model = TokenClassifier(
        embeddings=one_hot(corpus.train), label_dictionary=labels, label_type="ner", span_encoding="BIO"
    )
    return model, corpus, {}


def build_span(folder: Path, seed: int = SEED) -> Built:
    """SpanClassifier (entity linking, ``nel``); odd-indexed train sentences have no linked mention."""
    flair.set_seed(seed)
    corpus = make_corpus(split_map(LINKS, lambda text: marked(text, "nel")), "tiny-links")
    labels = corpus.make_label_dictionary("nel", add_unk=True)
    model = SpanClassifier(embeddings=one_hot(corpus.train), label_dictionary=labels, label_type="nel")
    return model, corpus, {}


def build_relation_extractor(folder: Path, seed: int = SEED) -> Built:
    """RelationExtractor over all entity pairs; odd-indexed train sentences have no entity pair."""
    flair.set_seed(seed)
    corpus = relation_corpus()
    labels = corpus.make_label_dictionary("relation", add_unk=False)
    labels.add_item("O")  # the entity pairs without a relation
    model = RelationExtractor(
        embeddings=one_hot(corpus.train),
        label_type="relation",
        entity_label_type="ner",
        label_dictionary=labels,
        train_on_gold_pairs_only=False,
    )
    return model, corpus, {}


def build_relation_classifier(folder: Path, seed: int = SEED) -> Built:
    """RelationClassifier on its transformed corpus (one encoded sentence per entity pair)."""
    flair.set_seed(seed)
    corpus = relation_corpus()
    labels = corpus.make_label_dictionary("relation", add_unk=False)
    options: dict[str, Any] = {"label_dictionary": labels, "label_type": "relation", "entity_label_types": "ner"}
    # the entity markers ([HEAD-PER] ...) are words too: a throwaway model transforms the corpus for the vocabulary
    encoded = RelationClassifier(pooled(one_hot(corpus.train)), **options).transform_corpus(corpus)
    flair.set_seed(seed)
    model = RelationClassifier(pooled(one_hot(encoded.train)), **options)
    return model, model.transform_corpus(corpus), {}


def _transformer_options() -> dict[str, Any]:
    return {"fine_tune": True, "layers": "-1", "layer_mean": False}


def build_tars_classifier(folder: Path, seed: int = SEED) -> Built:
    """TARSClassifier on TREC questions with a tiny random BERT; all labels per sentence (no negative sampling)."""
    flair.set_seed(seed)
    corpus = trec()
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    bert = tiny_bert(folder, points_of(corpus), labels.get_items())
    model = TARSClassifier(
        task_name="question classification",
        label_dictionary=labels,
        label_type=TREC_LABEL_TYPE,
        embeddings=TransformerDocumentEmbeddings(str(bert), **_transformer_options()),
        num_negative_labels_to_sample=None,  # flair samples negatives with an unseeded numpy generator
    )
    return model, corpus, {}


def build_tars_tagger(folder: Path, seed: int = SEED) -> Built:
    """TARSTagger on NER spans with a tiny random BERT; all labels per sentence (no negative sampling)."""
    flair.set_seed(seed)
    corpus = ner_corpus()
    labels = corpus.make_label_dictionary("ner", add_unk=False)
    bert = tiny_bert(folder, points_of(corpus), labels.get_items())
    model = TARSTagger(
        task_name="ner",
        label_dictionary=labels,
        label_type="ner",
        embeddings=TransformerWordEmbeddings(str(bert), **_transformer_options()),
        num_negative_labels_to_sample=None,
        **NO_DROPOUT,  # TARSTagger's inner SequenceTagger defaults to word and locked dropout
    )
    return model, corpus, {}


def build_multitask(folder: Path, seed: int = SEED) -> Built:
    """MultitaskModel of two TextClassifiers sharing one embedding: TREC question class and review sentiment."""
    flair.set_seed(seed)
    questions = trec(train_size=8, dev_size=2, test_size=2)
    reviews = make_corpus(
        split_map(REVIEWS, lambda item: labelled(item[0], "sentiment", ["positive" if item[1] > 3 else "negative"])),
        "tiny-sentiment",
    )
    shared = pooled(one_hot([*questions.train, *reviews.train]))
    question_model = TextClassifier(
        shared, label_type=TREC_LABEL_TYPE, label_dictionary=questions.make_label_dictionary(TREC_LABEL_TYPE)
    )
    review_model = TextClassifier(
        shared, label_type="sentiment", label_dictionary=reviews.make_label_dictionary("sentiment")
    )
    model, corpus = make_multitask_model_and_corpus([(question_model, questions), (review_model, reviews)])
    return model, corpus, {}


def build_deep_ncm(folder: Path, seed: int = SEED) -> Built:
    """TextClassifier with a DeepNCM decoder; needs flair's DeepNCMPlugin to update its class prototypes."""
    flair.set_seed(seed)
    corpus = trec()
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    document = pooled(one_hot(corpus.train))
    decoder = DeepNCMDecoder(
        label_dictionary=labels, embeddings_size=document.embedding_length, encoding_dim=8, mean_update_method="online"
    )
    model = TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels, decoder=decoder)
    return model, corpus, {"plugins": [DeepNCMPlugin()]}


def build_prototypes(folder: Path, seed: int = SEED) -> Built:
    """TextClassifier with a PrototypicalDecoder (learned prototypes, euclidean distance)."""
    flair.set_seed(seed)
    corpus = trec()
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    document = pooled(one_hot(corpus.train))
    decoder = PrototypicalDecoder(
        num_prototypes=len(labels),
        embeddings_size=document.embedding_length,
        prototype_size=8,
        distance_function="euclidean",
        normal_distributed_initial_prototypes=True,
    )
    model = TextClassifier(document, label_type=TREC_LABEL_TYPE, label_dictionary=labels, decoder=decoder)
    return model, corpus, {}


LONGEST_WORD = "extraordinarily/extraordinarily"


def build_lemmatizer(folder: Path, seed: int = SEED) -> Built:
    """Lemmatizer (character encoder-decoder with attention) with its own character dictionary."""
    flair.set_seed(seed)
    # flair pads every word of a batch to the longest one and counts the padding in the loss: one word longer than
    # all others in every sentence makes each rank's padding that of the union of their batches
    corpus = make_corpus(split_map(LEMMAS, lambda text: lemmatised(f"{text} {LONGEST_WORD}")), "tiny-lemmas")
    characters = Dictionary(add_unk=True)  # the default dictionary would be downloaded
    words = {token.text for sentence in points_of(corpus) for token in sentence}
    lemmas = {token.get_label("lemma").value for sentence in points_of(corpus) for token in sentence}
    for character in sorted(set("".join(words | lemmas))):
        characters.add_item(character)
    model = Lemmatizer(
        embeddings=None,
        label_type="lemma",
        rnn_input_size=8,
        rnn_hidden_size=DIM,
        rnn_layers=1,
        char_dict=characters,
    )
    return model, corpus, {}


ZOO: dict[str, Builder] = {
    "text": build_text,
    "text_missing_labels": build_text_missing_labels,
    "multi_label": build_multi_label,
    "regressor": build_regressor,
    "pair": build_pair,
    "triple": build_triple,
    "tagger_crf": build_tagger_crf,
    "tagger": build_tagger,
    "token": build_token,
    "span": build_span,
    "relation_extractor": build_relation_extractor,
    "relation_classifier": build_relation_classifier,
    "tars_classifier": build_tars_classifier,
    "tars_tagger": build_tars_tagger,
    "multitask": build_multitask,
    "deep_ncm": build_deep_ncm,
    "prototypes": build_prototypes,
    "lemmatizer": build_lemmatizer,
}

# builders whose odd-indexed train data points have nothing to learn (see the module docstring)
NOTHING_TO_LEARN_ON_ODD = ("relation_extractor", "span", "text_missing_labels")


def learns_nothing(model: Model, sentences: Sequence[DataPoint]) -> bool:
    """Whether ``model.forward_loss(sentences)`` (in training mode) gives a loss without a ``grad_fn``.

    Such a loss is a constant leaf: backpropagating it gives no parameter a gradient. The embeddings the forward
    pass leaves on the sentences are cleared again. (Some models change state in ``forward_loss``: the DeepNCM
    decoder accumulates prototype updates, TokenClassifier writes BIO tags onto the tokens.)
    """
    was_training = model.training
    model.train()
    try:
        loss, _ = model.forward_loss(list(sentences))
    finally:
        model.train(was_training)
        for point in sentences:
            point.clear_embeddings()
    return loss.grad_fn is None


def limit_passes(model: Model, most_points: int, ranks: Sequence[int]) -> None:
    """Make ``model`` run out of memory, as a CUDA device does, on any pass of more than ``most_points`` data points
    on the given global ranks (``torch.OutOfMemoryError``): a model whose batches fit only in chunks."""
    train_on = type(model).forward_loss

    def forward_loss(self: Model, points: list) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if len(points) > most_points and rank in ranks:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {len(points)} > {most_points} data points)")
        return train_on(self, points)

    model.forward_loss = types.MethodType(forward_loss, model)  # type: ignore[method-assign]


def rank_batches(points: Sequence[DataPoint], rank: int, world_size: int = 2, batch_size: int = 2) -> list[list[Any]]:
    """The batches one rank gets from strided sharding: points rank, rank + world_size, ... in batches."""
    shard = list(points)[rank::world_size]
    return [shard[start : start + batch_size] for start in range(0, len(shard), batch_size)]


def parameter_count(model: Model) -> int:
    """Number of parameters (shared ones counted once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def same_state(a: Model, b: Model) -> bool:
    """Whether two models have identical state dicts."""
    first, second = a.state_dict(), b.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


def self_check(epochs: int = 1, names: Sequence[str] = ()) -> bool:
    """Build, train (flair's own ModelTrainer, one process) and predict with every model; print one line each."""
    import logging

    from flair.trainers import ModelTrainer

    flair.device = torch.device("cpu")
    logging.getLogger("flair").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    all_ok = True
    print(f"{'name':22}{'build s':>8}{'train s':>8}{'params':>8}  same init  predicted  odd/even learn nothing")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or ZOO:
            folder = Path(tmp) / name
            start = time.perf_counter()
            model, corpus, extra = ZOO[name](folder / "a")
            built = time.perf_counter() - start
            same_init = same_state(model, ZOO[name](folder / "b")[0])
            layout = ""
            if name in NOTHING_TO_LEARN_ON_ODD:
                train = list(corpus.train)
                odd = all(learns_nothing(model, batch) for batch in rank_batches(train, rank=1))
                even = any(learns_nothing(model, batch) for batch in rank_batches(train, rank=0))
                layout = f"{odd}/{even}"
                all_ok &= odd and not even
            start = time.perf_counter()
            ModelTrainer(model, corpus).train(
                folder / "run",
                max_epochs=epochs,
                mini_batch_size=4,
                learning_rate=0.1,
                shuffle=False,
                create_file_logs=False,
                save_final_model=False,
                **extra,
            )
            trained = time.perf_counter() - start
            test = list(corpus.test)
            model.predict(test, label_name="zoo")
            predicted = sum(len(point.get_labels("zoo")) for point in test)
            all_ok &= same_init
            size = parameter_count(model)
            print(
                f"{name:22}{built:8.2f}{trained:8.2f}{size:8d}  {same_init!s:9}  {predicted:9d}  {layout}", flush=True
            )
    print("all ok" if all_ok else "FAILED")
    return all_ok


if __name__ == "__main__":
    arguments = sys.argv[1:]
    epoch_count = int(arguments.pop(0)) if arguments and arguments[0].isdigit() else 1
    sys.exit(0 if self_check(epoch_count, arguments) else 1)
