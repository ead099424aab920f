"""How fast ``python -m flair_fabric train`` answers ``--help`` and refuses a bad config:

    python benchmarks/command_line.py [--repeats 10] [--out benchmarks/results]

Each case is a fresh interpreter (what a user or a batch script pays), run ``--repeats`` times after one warm-up run
(the operating system's file cache warm, as on a second try): the median and the slowest wall time. The reference,
in the same run, is what any flair script pays before it can look at its own arguments: ``python -c "import flair"``
(``import_flair``); ``ratio`` is a case's median over that median. The cases:

- ``help``: ``train --help`` (every key, from the signatures);
- ``unknown_key``: a config with ``trainer.max_epoch`` (refused, the closest key suggested);
- ``wrong_type``: ``trainer.max_epochs: ten``;
- ``yaml_error``: an unclosed ``[`` (the file and line);
- ``missing_folder``: a ``ColumnCorpus`` whose ``data_folder`` does not exist;
- ``unknown_class``: ``flair.models.TextClassifer`` (the second pass: flair is imported to look it up).

Each case must end as expected (``--help``: exit code 0; the others: exit code 2 and the key in the message), else
the benchmark fails. Writes ``command_line.json`` and ``command_line.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = """\
corpus:
  class_path: flair_fabric.datasets.TREC
  init_args: {train_size: 100}
embeddings:
  class_path: flair.embeddings.TransformerDocumentEmbeddings
  init_args: {model: any}
model:
  class_path: flair.models.TextClassifier
  init_args: {label_type: question_class}
trainer:
  base_path: out
  max_epochs: 2
"""
BROKEN = {
    "unknown_key": ("max_epochs: 2", "max_epoch: 2", "trainer.max_epoch"),
    "wrong_type": ("max_epochs: 2", "max_epochs: ten", "trainer.max_epochs"),
    "yaml_error": ("max_epochs: 2", "max_epochs: [2", "YAML syntax error"),
    "missing_folder": (
        "class_path: flair_fabric.datasets.TREC\n  init_args: {train_size: 100}",
        "class_path: flair.datasets.ColumnCorpus\n  init_args: {data_folder: /nowhere, column_format: {0: text}}",
        "corpus.init_args.data_folder",
    ),
    "unknown_class": ("TextClassifier", "TextClassifer", "model.class_path"),
}


def timed(command: list[str], expect_code: int, expect_text: str) -> float:
    """Wall seconds of one run of ``command``, which must exit with ``expect_code`` and print ``expect_text``."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != expect_code or expect_text not in output:
        raise SystemExit(f"{command}: exit {done.returncode}, expected {expect_code} and {expect_text!r}:\n{output}")
    return seconds


def measure(command: list[str], expect_code: int, expect_text: str, repeats: int) -> dict[str, Any]:
    timed(command, expect_code, expect_text)  # warm-up
    times = [timed(command, expect_code, expect_text) for _ in range(repeats)]
    return {"median_s": statistics.median(times), "max_s": max(times), "runs": times}


def cases(folder: Path) -> dict[str, tuple[list[str], int, str]]:
    train = [sys.executable, "-m", "flair_fabric", "train"]
    found = {
        "import_flair": ([sys.executable, "-c", "import flair"], 0, ""),
        "help": ([*train, "--help"], 0, "--trainer.max_epochs"),
    }
    for name, (text, replacement, says) in BROKEN.items():
        file = folder / f"{name}.yaml"
        file.write_text(CONFIG.replace(text, replacement), encoding="utf-8")
        found[name] = ([*train, str(file)], 2, says)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        results = {
            name: measure(command, code, text, args.repeats)
            for name, (command, code, text) in cases(Path(temporary)).items()
        }
    reference = results["import_flair"]["median_s"]
    for result in results.values():
        result["ratio"] = result["median_s"] / reference
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command_line.json").write_text(json.dumps({"repeats": args.repeats, "cases": results}, indent=2))
    lines = [
        f"# `python -m flair_fabric train`: answer times ({args.repeats} runs each, fresh interpreters)",
        "",
        "| case | median | slowest | median / `import flair` |",
        "|---|---|---|---|",
    ]
    for name, result in results.items():
        lines.append(f"| {name} | {result['median_s']:.2f} s | {result['max_s']:.2f} s | {result['ratio']:.2f} |")
    (args.out / "command_line.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
