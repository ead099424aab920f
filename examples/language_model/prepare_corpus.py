"""Cut plain English text into flair's ``TextCorpus`` layout for training a character language model.

    python examples/language_model/prepare_corpus.py /tmp/austen_corpus                 # 8 train splits
    python examples/language_model/prepare_corpus.py /tmp/austen_corpus --splits 2 --valid-fraction 0.03
    python examples/language_model/prepare_corpus.py /tmp/corpus --source book1.txt --source books/

By default the text is Jane Austen's six novels shipped in ``flair_fabric/data/austen`` (public domain, from
Project Gutenberg; see ``PROVENANCE.md`` there). ``--source`` takes UTF-8 text files or folders of ``*.txt`` instead.
The output folder gets::

    <out>/train/train_split_1 ... train_split_N   # N roughly equal parts (by characters), cut at line boundaries
    <out>/valid.txt                              # --valid-fraction of the text (default 2%)
    <out>/test.txt                               # --test-fraction of the text (default 2%)
    <out>/chars.pkl                              # flair.data.Dictionary of every character (and <unk>)

which is what ``flair.trainers.language_model_trainer.TextCorpus(<out>, Dictionary.load_from_file(<out>/chars.pkl))``
reads. Everything is deterministic: no random numbers are drawn.

Normalisation is light: a Project Gutenberg header and licence footer are cut off if present, line ends become
``\\n``, text is put in Unicode NFC and trailing spaces are dropped. The hard-wrapped lines of a paragraph are then
joined into one line per paragraph, runs of spaces made single (``--keep-line-breaks`` keeps the lines as they are,
only collapsing runs of blank lines), because ``TextCorpus`` treats each line as a document: it drops blank lines
and shuffles the lines of each training split, so ~70-character fragments of wrapped prose would lose their context.

Held-out text comes from fixed positions: the text is cut into ``--holdout-blocks`` equal parts (default 20) and the
end of each part goes to ``test.txt``, the lines just before it to ``valid.txt``, so both sample every book while
staying contiguous prose. Any old ``train_split_*`` files are replaced; anything else in ``<out>/train`` is an error,
since ``TextCorpus`` would train on every file there.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from flair.data import Dictionary

# The novels of flair_fabric/data/austen, in publication order.
AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)

_GUTENBERG_START = re.compile(r"^\s*(\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT)", re.I)
_GUTENBERG_END = re.compile(r"^\s*(\*{3}\s*)?END OF (THE |THIS )?PROJECT GUTENBERG", re.I)


def austen_dir() -> Path:
    """``flair_fabric/data/austen``, found without importing ``flair_fabric`` (which would load Lightning)."""
    spec = importlib.util.find_spec("flair_fabric")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("flair_fabric is not installed: pass --source")
    return Path(spec.origin).parent / "data" / "austen"


def default_sources() -> list[Path]:
    """The six Austen novels, in publication order."""
    return [austen_dir() / f"{name}.txt" for name in AUSTEN_NOVELS]


def expand_sources(sources: Sequence[Path]) -> list[Path]:
    """Files stay as given; a folder becomes its ``*.txt`` files in name order."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            found = sorted(source.glob("*.txt"))
            if not found:
                raise FileNotFoundError(f"no *.txt files in {source}")
            files.extend(found)
        elif source.is_file():
            files.append(source)
        else:
            raise FileNotFoundError(source)
    return files


def strip_gutenberg(lines: list[str]) -> list[str]:
    """Drop a Project Gutenberg header (up to its START marker) and footer (from its END marker), if present."""
    start = next((i + 1 for i, line in enumerate(lines) if _GUTENBERG_START.match(line)), 0)
    end = next((i for i in range(start, len(lines)) if _GUTENBERG_END.match(lines[i])), len(lines))
    return lines[start:end]


def normalise(text: str, keep_line_breaks: bool = False) -> list[str]:
    """Light clean-up of one text; returns its lines (one per paragraph unless ``keep_line_breaks``), no blank ones
    at either end and, when paragraphs are joined, none at all."""
    text = unicodedata.normalize("NFC", text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n"))
    lines = [line.rstrip() for line in strip_gutenberg(text.split("\n"))]
    out: list[str] = []
    if keep_line_breaks:
        for line in lines:
            if line or (out and out[-1]):  # at most one blank line in a row
                out.append(line)
        while out and not out[-1]:
            out.pop()
        return out
    paragraph: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            paragraph.append(" ".join(line.split()))
        elif paragraph:
            out.append(" ".join(paragraph))
            paragraph = []
    return out


def _size(lines: Sequence[str]) -> int:
    """Characters the lines take in a file, newlines included."""
    return sum(len(line) + 1 for line in lines)


def cut(lines: Sequence[str], parts: int) -> list[list[str]]:
    """Cut ``lines`` into ``parts`` consecutive, non-empty pieces of roughly equal character size."""
    if not 1 <= parts <= len(lines):
        raise ValueError(f"cannot cut {len(lines)} lines into {parts} parts")
    pieces: list[list[str]] = []
    total, start, done = _size(lines), 0, 0
    for index, line in enumerate(lines):
        done += len(line) + 1
        remaining_parts = parts - len(pieces) - 1
        enough = done >= total * (len(pieces) + 1) / parts
        if remaining_parts > 0 and (enough or len(lines) - index - 1 == remaining_parts):
            pieces.append(list(lines[start : index + 1]))
            start = index + 1
    pieces.append(list(lines[start:]))
    return pieces


def hold_out(
    lines: Sequence[str], valid_fraction: float, test_fraction: float, blocks: int
) -> tuple[list[str], list[str], list[str]]:
    """Split into train, valid and test: the end of each of ``blocks`` equal parts is test, the lines before it valid.

    Each held-out piece takes whole lines until it has its fraction of the part's characters (at least one line).
    """
    if not (0 < valid_fraction < 0.5 and 0 < test_fraction < 0.5):
        raise ValueError("valid and test fractions must lie strictly between 0 and 0.5")
    train: list[str] = []
    valid: list[str] = []
    test: list[str] = []
    for part in cut(lines, blocks):
        end = len(part)
        cuts = []
        for fraction in (test_fraction, valid_fraction):
            target, taken, start = fraction * _size(part), 0, end
            while start > 1 and (start == end or taken < target):
                start -= 1
                taken += len(part[start]) + 1
            if start == end:
                raise ValueError("a hold-out block is too small: use fewer --holdout-blocks")
            cuts.append((start, end))
            end = start
        (test_start, test_end), (valid_start, valid_end) = cuts
        train.extend(part[:valid_start])
        valid.extend(part[valid_start:valid_end])
        test.extend(part[test_start:test_end])
    return train, valid, test


def character_dictionary(texts: Sequence[Sequence[str]], case_variants: bool = True) -> Dictionary:
    """A flair ``Dictionary`` of ``<unk>`` and every character in ``texts`` (``\\n`` included), sorted by code point.

    With ``case_variants`` the one-character upper and lower case forms are added too: ``TextCorpus`` flips the case
    of ~2% of the lines at random (``random_case_flip=True``), and those characters should not become ``<unk>``.
    """
    chars = {"\n"}
    for lines in texts:
        for line in lines:
            chars.update(line)
    if case_variants:
        chars |= {variant for char in chars for variant in (char.upper(), char.lower()) if len(variant) == 1}
    dictionary = Dictionary(add_unk=True)
    for char in sorted(chars):
        dictionary.add_item(char)
    return dictionary


def _write(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def prepare_corpus(
    out: Path,
    sources: Sequence[Path] | None = None,
    splits: int = 8,
    valid_fraction: float = 0.02,
    test_fraction: float = 0.02,
    holdout_blocks: int = 20,
    keep_line_breaks: bool = False,
    case_variants: bool = True,
) -> dict[str, int]:
    """Write ``out/train/train_split_{1..splits}``, ``out/valid.txt``, ``out/test.txt`` and ``out/chars.pkl``.

    Returns the character count of each file written and the dictionary size (``"chars.pkl"``).
    """
    files = expand_sources(sources) if sources else default_sources()
    lines: list[str] = []
    for file in files:
        lines.extend(normalise(file.read_text(encoding="utf-8"), keep_line_breaks))
    train, valid, test = hold_out(lines, valid_fraction, test_fraction, holdout_blocks)
    train_dir = out / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    stale = sorted(train_dir.iterdir())
    unexpected = [path.name for path in stale if not (path.is_file() and path.name.startswith("train_split_"))]
    if unexpected:
        raise FileExistsError(f"{train_dir} holds {unexpected}: TextCorpus would train on them; remove them first")
    for path in stale:
        path.unlink()

    sizes: dict[str, int] = {}
    for number, piece in enumerate(cut(train, splits), start=1):
        _write(train_dir / f"train_split_{number}", piece)
        sizes[f"train/train_split_{number}"] = _size(piece)
    for name, piece in (("valid.txt", valid), ("test.txt", test)):
        _write(out / name, piece)
        sizes[name] = _size(piece)

    dictionary = character_dictionary([train, valid, test], case_variants)
    dictionary.save(out / "chars.pkl")
    if Dictionary.load_from_file(out / "chars.pkl") != dictionary:
        raise RuntimeError("chars.pkl does not load back as the same Dictionary")
    sizes["chars.pkl"] = len(dictionary)
    return sizes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder (train/, valid.txt, test.txt, chars.pkl)")
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        help="UTF-8 text file or folder of *.txt; repeat for more (default: the bundled Austen novels)",
    )
    parser.add_argument("--splits", type=int, default=8, help="training split files (default: 8)")
    parser.add_argument("--valid-fraction", type=float, default=0.02, help="share of text for valid.txt (0.02)")
    parser.add_argument("--test-fraction", type=float, default=0.02, help="share of text for test.txt (0.02)")
    parser.add_argument("--holdout-blocks", type=int, default=20, help="places held-out text is taken from (20)")
    parser.add_argument("--keep-line-breaks", action="store_true", help="keep wrapped lines, not one per paragraph")
    parser.add_argument(
        "--no-case-variants", action="store_true", help="dictionary: only characters seen, not their case forms"
    )
    args = parser.parse_args(argv)
    sizes = prepare_corpus(
        args.out,
        args.source,
        splits=args.splits,
        valid_fraction=args.valid_fraction,
        test_fraction=args.test_fraction,
        holdout_blocks=args.holdout_blocks,
        keep_line_breaks=args.keep_line_breaks,
        case_variants=not args.no_case_variants,
    )
    dictionary_size = sizes.pop("chars.pkl")
    for name, size in sizes.items():
        print(f"{args.out / name}: {size:,} characters")
    print(f"{args.out / 'chars.pkl'}: {dictionary_size} entries (<unk> included)")


if __name__ == "__main__":
    main()
