"""A loss that cannot be computed because a gold label is not in the model's label dictionary, named.

flair's losses encode every gold label with the model's ``label_dictionary``; a label the model never saw (a test
set's new class or entity type) makes ``Dictionary.get_idx_for_item`` raise a bare ``IndexError`` (where the
dictionary has no ``<unk>``). flair's trainer evaluates its final test without the loss for that reason. Here the
error is caught where a loss was asked for and turned into a ``ValueError`` that names the label and the way out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

TAG_PREFIXES = ("B-", "I-", "E-", "S-")
"""The prefixes flair's span taggers put before a label value in their tag dictionary (BIO and BIOES)."""


class UnknownGoldLabel(ValueError):
    """A loss was asked for, but a gold label is not in the model's label dictionary."""


def _known(value: str, items: set[str]) -> bool:
    return value in items or any(prefix + value in items for prefix in TAG_PREFIXES)


def unknown_gold_labels(model: Any, data_points: Sequence[Any]) -> list[str]:
    """The gold values of ``model.label_type`` on ``data_points`` (in order of appearance) that the model's label
    dictionary cannot encode; empty where the dictionary has ``<unk>`` or the model has no label dictionary."""
    dictionary = getattr(model, "label_dictionary", None)
    label_type = getattr(model, "label_type", None)
    if dictionary is None or label_type is None or getattr(dictionary, "add_unk", False):
        return []
    items = set(dictionary.get_items())
    unknown: dict[str, None] = {}
    for data_point in data_points:
        for label in data_point.get_labels(label_type):
            if label.value != "O" and not _known(label.value, items):
                unknown[label.value] = None
    return list(unknown)


@contextlib.contextmanager
def loss_labels_named(model: Any, data_points: Sequence[Any], return_loss: bool) -> Iterator[None]:
    """Inside the block the model predicts ``data_points``; an ``IndexError`` of a loss that cannot encode a gold
    label becomes an :class:`UnknownGoldLabel` naming it (any other error passes unchanged)."""
    try:
        yield
    except IndexError as error:
        unknown = unknown_gold_labels(model, data_points) if return_loss else []
        if not unknown:
            raise
        known = sorted(model.label_dictionary.get_items())
        labels, verb = ("gold labels", "are") if len(unknown) > 1 else ("gold label", "is")
        raise UnknownGoldLabel(
            f"the loss cannot be computed: the {labels} {', '.join(repr(value) for value in unknown)} of label type"
            f" {model.label_type!r} {verb} not in the model's label dictionary, which has no <unk> (it holds"
            f" {known[:20]}{' ...' if len(known) > 20 else ''}). Leave the loss out (return_loss=False; python -m"
            " flair_fabric evaluate computes none unless --loss is given), or score labels the model was trained on."
        ) from error
