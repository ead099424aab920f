"""``MappedCorpus``: a flair ``Corpus`` whose splits are memory-mapped, built from flair's file formats or from a
corpus already in memory, with flair's dictionaries computed from the stored columns."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from flair.data import Corpus, Dictionary
from flair.datasets import DataLoader
from flair.datasets.base import find_train_dev_test_files
from flair.embeddings import OneHotEmbeddings
from flair.tokenization import SegtokTokenizer, Tokenizer
from torch.utils.data import ConcatDataset, Dataset, Subset

from flair_fabric.data.builders import Opened, from_datasets, from_files
from flair_fabric.data.dictionaries import label_dictionary, most_common, token_counter
from flair_fabric.data.readers import read_classification_file, read_column_file, read_csv_file
from flair_fabric.data.remote import split_files, store_of
from flair_fabric.data.split import MappedSplit
from flair_fabric.storage import is_url

Files = tuple[Any, Any, Any]


def _split_files(
    data_folder: str | Path,
    dev_file: str | Path | None,
    test_file: str | Path | None,
    train_file: str | Path | None,
    autofind_splits: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Files:
    """flair's dev, test and train files of ``data_folder`` (a path, or a URL: see docs/storage.md)."""
    if is_url(data_folder):
        return split_files(str(data_folder), dev_file, test_file, train_file, autofind_splits, storage_options)
    return find_train_dev_test_files(data_folder, dev_file, test_file, train_file, autofind_splits)


def _as_view(dataset: Dataset | None) -> Dataset | None:
    """flair's sampled splits (``Subset``\\ s of a mapped split) as selections of the mapped split."""
    if isinstance(dataset, Subset):
        base = _as_view(dataset.dataset)
        if isinstance(base, MappedSplit):
            return base.select(list(dataset.indices))
    return dataset


def _draw_as_flair_does(datasets: list, times: int) -> None:
    """Start (and drop) the data loaders flair's own method would iterate: each draws a seed from torch's random
    generator, so that the random state after this method is the state after flair's (a model made next starts from
    the same weights)."""
    for _ in range(times):
        iter(DataLoader(ConcatDataset(datasets), batch_size=1))


def _describe(tokenizer: Tokenizer | bool) -> str:
    if isinstance(tokenizer, bool):
        return repr(tokenizer)
    return f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}:{sorted(vars(tokenizer).items())!r}"


class MappedCorpus(Corpus):
    """A flair ``Corpus`` of :class:`~flair_fabric.data.split.MappedSplit`\\ s: flair's ``ModelTrainer`` and models
    take it as they take any corpus. Missing splits are sampled from train as flair's ``Corpus`` samples them (the
    same data points for the same random state), as selections of the stored train split.

    ``cache_folder``: the cache entry the splits are read from; ``built``: whether opening it built it;
    ``downloaded``: whether opening it downloaded it from the store (docs/storage.md)."""

    def __init__(
        self,
        opened: Opened,
        name: str = "corpus",
        sample_missing_splits: bool | str = True,
        random_seed: int | None = None,
    ) -> None:
        splits = opened.splits
        super().__init__(
            splits["train"],
            splits["dev"],
            splits["test"],
            name=name,
            sample_missing_splits=sample_missing_splits,
            random_seed=random_seed,
        )
        self._train, self._dev, self._test = _as_view(self._train), _as_view(self._dev), _as_view(self._test)
        self.cache_folder: Path = opened.folder
        self.built: bool = opened.built
        self.downloaded: bool = opened.downloaded

    def _mapped(self, *datasets: Dataset | None) -> list[MappedSplit] | None:
        present = [dataset for dataset in datasets if dataset is not None]
        mapped = [dataset for dataset in present if isinstance(dataset, MappedSplit)]
        return mapped if len(mapped) == len(present) else None

    def make_label_dictionary(
        self, label_type: str, min_count: int = -1, add_unk: bool = False, add_dev_test: bool = False
    ) -> Dictionary:
        """flair's label dictionary (same items, order, ``multi_label`` and ``span_labels``), from stored columns;
        torch's random state afterwards is the state flair's method leaves."""
        assert self.train
        datasets = [self.train, *((self.dev, self.test) if add_dev_test else ())]
        splits = self._mapped(*datasets)
        if splits is None:
            return super().make_label_dictionary(label_type, min_count, add_unk, add_dev_test)
        dictionary = label_dictionary(splits, label_type, min_count, add_unk)
        _draw_as_flair_does(datasets, 2)
        return dictionary

    def make_vocab_dictionary(self, max_tokens: int = -1, min_freq: int = 1) -> Dictionary:
        """flair's vocabulary of the train split (same items, same order), from the stored tokens."""
        train = self._mapped(self.train)
        if not train or train[0].is_pair:
            return super().make_vocab_dictionary(max_tokens, min_freq)
        vocabulary = Dictionary()
        for token in most_common(token_counter(train[0]), max_tokens, min_freq):
            vocabulary.add_item(token)
        _draw_as_flair_does(train, 1)
        return vocabulary

    def one_hot_embeddings(self, field: str = "text", min_freq: int = 3, **kwargs: Any) -> OneHotEmbeddings:
        """What ``OneHotEmbeddings.from_corpus(corpus, field, min_freq, **kwargs)`` gives, from the stored columns
        (``from_corpus`` itself also works on this corpus, building every train sentence)."""
        train = self._mapped(self.train)
        if not train or train[0].is_pair:
            return OneHotEmbeddings.from_corpus(self, field=field, min_freq=min_freq, **kwargs)
        vocabulary = Dictionary()
        counter = token_counter(train[0], field)
        for token in most_common(counter, -1, min_freq):
            vocabulary.add_item(token)
        _draw_as_flair_does(train, 1)
        return OneHotEmbeddings(vocabulary, field=field, **kwargs)

    @classmethod
    def from_column_files(
        cls,
        data_folder: str | Path,
        column_format: dict[int, str],
        train_file: str | Path | None = None,
        test_file: str | Path | None = None,
        dev_file: str | Path | None = None,
        autofind_splits: bool = True,
        name: str | None = None,
        comment_symbol: str | None = "# ",
        column_delimiter: str = r"\s+",
        encoding: str = "utf-8",
        document_separator_token: str | None = None,
        skip_first_line: bool = False,
        label_name_map: dict[str, str] | None = None,
        banned_sentences: list[str] | None = None,
        default_whitespace_after: int = 1,
        every_sentence_is_independent: bool = False,
        documents_as_sentences: bool = False,
        sample_missing_splits: bool | str = True,
        random_seed: int | None = None,
        cache_folder: str | Path | None = None,
        in_memory: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> MappedCorpus:
        """What flair's ``ColumnCorpus`` reads with these arguments (the same names and defaults; ``in_memory``
        changes nothing here), stored once in the cache and memory-mapped."""
        store = store_of(data_folder, cache_folder, storage_options)
        dev, test, train = _split_files(data_folder, dev_file, test_file, train_file, autofind_splits, storage_options)
        options = {
            "column_delimiter": column_delimiter,
            "comment_symbol": comment_symbol,
            "encoding": encoding,
            "document_separator_token": document_separator_token,
            "skip_first_line": skip_first_line,
            "label_name_map": label_name_map,
            "banned_sentences": banned_sentences,
            "default_whitespace_after": default_whitespace_after,
            "every_sentence_is_independent": every_sentence_is_independent,
            "documents_as_sentences": documents_as_sentences,
        }
        columns = {int(column): kind for column, kind in column_format.items()}
        read = functools.partial(
            read_column_file, column_format=columns, options=options, storage_options=storage_options
        )
        keyed = {**options, "reader": "column", "column_format": sorted(columns.items())}
        splits = {"train": train, "dev": dev, "test": test}
        opened = from_files(splits, keyed, read, cache_folder, linked=True, store=store)
        return cls(opened, str(data_folder) if name is None else name, sample_missing_splits, random_seed)

    @classmethod
    def from_classification_files(
        cls,
        data_folder: str | Path,
        label_type: str = "class",
        train_file: str | Path | None = None,
        test_file: str | Path | None = None,
        dev_file: str | Path | None = None,
        truncate_to_max_tokens: int = -1,
        truncate_to_max_chars: int = -1,
        filter_if_longer_than: int = -1,
        tokenizer: Tokenizer | bool = SegtokTokenizer(),  # noqa: B008 (flair's default)
        memory_mode: str = "partial",
        label_name_map: dict[str, str] | None = None,
        skip_labels: list[str] | None = None,
        allow_examples_without_labels: bool = False,
        sample_missing_splits: bool = True,
        encoding: str = "utf-8",
        cache_folder: str | Path | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> MappedCorpus:
        """What flair's ``ClassificationCorpus`` (FastText ``__label__`` lines) reads with these arguments."""
        store = store_of(data_folder, cache_folder, storage_options)
        dev, test, train = _split_files(data_folder, dev_file, test_file, train_file, True, storage_options)
        options = {
            "label_type": label_type,
            "truncate_to_max_tokens": truncate_to_max_tokens,
            "truncate_to_max_chars": truncate_to_max_chars,
            "filter_if_longer_than": filter_if_longer_than,
            "tokenizer": tokenizer,
            "memory_mode": memory_mode,
            "label_name_map": label_name_map,
            "skip_labels": skip_labels,
            "allow_examples_without_labels": allow_examples_without_labels,
            "encoding": encoding,
        }
        read = functools.partial(read_classification_file, options=options, storage_options=storage_options)
        keyed = {**options, "reader": "classification", "tokenizer": _describe(tokenizer)}
        opened = from_files({"train": train, "dev": dev, "test": test}, keyed, read, cache_folder, store=store)
        return cls(opened, str(data_folder), sample_missing_splits)

    @classmethod
    def from_csv(
        cls,
        data_folder: str | Path,
        column_name_map: dict[int, str],
        label_type: str,
        name: str = "csv_corpus",
        train_file: str | Path | None = None,
        test_file: str | Path | None = None,
        dev_file: str | Path | None = None,
        max_tokens_per_doc: int = -1,
        max_chars_per_doc: int = -1,
        tokenizer: Tokenizer = SegtokTokenizer(),  # noqa: B008 (flair's default)
        in_memory: bool = False,
        skip_header: bool = False,
        encoding: str = "utf-8",
        no_class_label: str | None = None,
        sample_missing_splits: bool | str = True,
        cache_folder: str | Path | None = None,
        storage_options: dict[str, Any] | None = None,
        **fmtparams: Any,
    ) -> MappedCorpus:
        """What flair's ``CSVClassificationCorpus`` reads with these arguments (``DataPair``\\ s where
        ``column_name_map`` names ``"pair"`` columns; ``in_memory`` changes nothing here)."""
        store = store_of(data_folder, cache_folder, storage_options)
        dev, test, train = _split_files(data_folder, dev_file, test_file, train_file, True, storage_options)
        options = {
            "label_type": label_type,
            "tokenizer": tokenizer,
            "max_tokens_per_doc": max_tokens_per_doc,
            "max_chars_per_doc": max_chars_per_doc,
            "skip_header": skip_header,
            "encoding": encoding,
            "no_class_label": no_class_label,
            "fmtparams": fmtparams,
        }
        columns = {int(column): kind for column, kind in column_name_map.items()}
        read = functools.partial(
            read_csv_file, column_name_map=columns, options=options, storage_options=storage_options
        )
        keyed = {**options, "reader": "csv", "tokenizer": _describe(tokenizer), "columns": sorted(columns.items())}
        opened = from_files({"train": train, "dev": dev, "test": test}, keyed, read, cache_folder, store=store)
        return cls(opened, name, sample_missing_splits)


def map_corpus(corpus: Corpus, cache_folder: str | Path | None = None) -> MappedCorpus:
    """A flair corpus already in memory, stored once (keyed by its content) and memory-mapped: the same splits, data
    points and labels. Data points other than sentences and pairs of sentences are refused with an
    :class:`~flair_fabric.data.errors.UnsupportedDataPointError` naming what is supported."""
    opened = from_datasets({"train": corpus.train, "dev": corpus.dev, "test": corpus.test}, cache_folder)
    return MappedCorpus(opened, corpus.name, sample_missing_splits=False)
