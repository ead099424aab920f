"""``python -m flair_fabric train|predict|evaluate``: ``train`` runs a YAML config (:mod:`flair_fabric.shell`);
``predict`` and ``evaluate`` are a thin command line over ``flair_fabric.predict`` and ``flair_fabric.evaluate``.

The options are parsed before torch, flair and Lightning are imported, so ``--help`` and argument errors answer at
once; the process options come from :class:`~flair_fabric.launch.arguments.LightningArguments`.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from flair_fabric import __version__
from flair_fabric.launch.arguments import LightningArguments
from flair_fabric.prediction import INPUT_FORMATS, OUTPUT_FORMATS

DESCRIPTION = """Train a flair model from a config; predict with or evaluate a trained one, split across processes.

examples:
  python -m flair_fabric train run.yaml --trainer.devices 4     (python -m flair_fabric train --help: every key)
  python -m flair_fabric predict --model out/best-model.pt --input big.conll --input-format conll
         --output big.pred.conll --devices 4 --mini-batch-size 64
  python -m flair_fabric evaluate --model out/best-model.pt --input test.conll --gold-label-type ner --devices 4
"""


def load_model(path: str) -> Any:
    """The flair model saved in ``path`` (a local file or a URL), or a clear error (missing file, not a flair
    model)."""
    from flair_fabric.storage import StorageError, check_reachable, is_url, local_file

    if is_url(path):
        try:
            check_reachable(path, argument="--model")
        except StorageError as error:
            raise SystemExit(str(error)) from None
    elif not Path(path).is_file():
        raise SystemExit(f"--model {path}: no such file; pass a model saved by flair (e.g. out/best-model.pt).")
    import flair

    try:
        with local_file(path) as file:
            return flair.nn.Model.load(file)
    except (pickle.UnpicklingError, RuntimeError, KeyError, ValueError, EOFError, AttributeError) as error:
        raise SystemExit(f"--model {path}: not a flair model file ({type(error).__name__}: {error}).") from None


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def _lightning_options(parser: argparse.ArgumentParser) -> None:
    """One option per Lightning argument (``--num-nodes`` for ``num_nodes``), default ``None``: not given."""
    group = parser.add_argument_group("processes (Lightning's arguments)")
    for each in fields(LightningArguments):
        default = "default: 32-true" if each.name == "precision" else f"default: {each.default}"
        shown = each.metadata["cli"] + ("" if "default" in each.metadata["cli"] else f" ({default})")
        group.add_argument(f"--{each.name.replace('_', '-')}", type=_number_or_text, default=None, help=shown)
    parser.add_argument("--mini-batch-size", type=int, default=32, help="data points per batch (default: 32)")


def parser() -> argparse.ArgumentParser:
    """The command line's parser (it imports nothing heavy)."""
    main = argparse.ArgumentParser(
        prog="python -m flair_fabric", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    main.add_argument("--version", action="version", version=f"flair-fabric {__version__}")
    commands = main.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train from a YAML config (python -m flair_fabric train --help)", add_help=False)
    commands.add_parser("cache", help="list|prune|verify the mapped corpora's cache (cache --help)", add_help=False)

    predict = commands.add_parser("predict", help="label a file with a trained model, split across processes")
    predict.add_argument("--model", required=True, help="a model file saved by flair")
    predict.add_argument("--input", required=True, help="the file to label (a path or URL: s3://bucket/in.txt)")
    predict.add_argument("--input-format", choices=INPUT_FORMATS, default="text", help="text: a sentence per line")
    predict.add_argument("--output", required=True, help="the file to write (written once, complete; or a URL)")
    predict.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None, help="default: from the suffix")
    predict.add_argument("--tokenizer", choices=("segtok", "space"), default="segtok", help="for text input")
    predict.add_argument("--label-name", default=None, help="the label name to write (default: the model's)")
    predict.add_argument("--chunk-size", type=int, default=None, help="records read at a time")
    predict.add_argument("--all-probabilities", action="store_true", help="scores of every class (classifiers)")
    _lightning_options(predict)

    evaluate = commands.add_parser("evaluate", help="score a trained model on a labelled CoNLL file")
    evaluate.add_argument("--model", required=True, help="a model file saved by flair")
    evaluate.add_argument("--input", required=True, help="CoNLL columns: token, then the gold labels (a path or a URL)")
    evaluate.add_argument("--gold-label-type", required=True, help="the label type to score, e.g. ner")
    evaluate.add_argument("--column", type=int, default=1, help="the column of the gold labels (default: 1)")
    evaluate.add_argument("--output", default=None, help="flair's prediction file (optional; a path or a URL)")
    evaluate.add_argument("--json", action="store_true", help="print the scores as JSON")
    evaluate.add_argument(
        "--loss",
        action="store_true",
        help="also compute the loss (none by default, as in flair's final test: it needs every gold label known)",
    )
    _lightning_options(evaluate)
    return main


def _checked_urls(given: str, output: str) -> bool:
    """``True`` when ``--input`` is a URL: it and a URL ``--output`` are checked (one line naming the option, the
    path and the fix, else ``SystemExit``); a local ``--output`` is checked by ``flair_fabric.predict``."""
    from flair_fabric.storage import StorageError, check_reachable, is_url

    try:
        if is_url(output):
            check_reachable(output, argument="--output", expect="folder")
        if is_url(given):
            check_reachable(given, argument="--input")
            return True
    except StorageError as error:
        raise SystemExit(str(error)) from None
    return False


def _evaluate(model: Any, args: argparse.Namespace, launch: dict[str, Any]) -> Any:
    """``flair_fabric.evaluate`` on ``--input``'s CoNLL file (a URL is read from a private local copy); a URL
    ``--output`` is written locally and uploaded in one piece once the evaluation has ended, by the process that
    wrote it (with the script relaunch every rank runs this, and global rank 0 writes)."""
    from flair.datasets import ColumnDataset

    import flair_fabric
    from flair_fabric.storage import is_url, local_file, write_atomically

    with local_file(args.input) as input_path, tempfile.TemporaryDirectory(prefix="flair-fabric-eval-") as folder:
        data = ColumnDataset(input_path, {0: "text", args.column: args.gold_label_type})
        if len(data) == 0:
            raise SystemExit(f"--input {args.input}: no sentences in it.")
        out_path = Path(folder) / "predictions.txt" if is_url(args.output) else args.output
        result = flair_fabric.evaluate(
            model,
            data,
            args.gold_label_type,
            out_path=out_path,
            mini_batch_size=args.mini_batch_size,
            return_loss=args.loss,
            **launch,
        )
        if out_path != args.output and Path(out_path).is_file():

            def copy_into(temporary: str) -> None:
                shutil.copyfile(out_path, temporary)

            write_atomically(args.output, copy_into)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["train"]:
        from flair_fabric.shell.command import main as train

        return train(words[1:])
    if words[:1] == ["cache"]:
        from flair_fabric.data.command import main as cache

        return cache(words[1:])
    args = parser().parse_args(words)
    url_input = _checked_urls(args.input, args.output)  # before the model loads
    if not url_input and not Path(args.input).is_file():
        raise SystemExit(f"--input {args.input}: no such file.")
    import flair_fabric  # here, after the arguments are known to be usable: torch, flair and Lightning load now

    model = load_model(args.model)
    given = {each.name: getattr(args, each.name) for each in fields(LightningArguments)}
    launch = {name: value for name, value in given.items() if value is not None}
    try:
        if args.command == "predict":
            summary = flair_fabric.predict(
                model,
                args.input,
                out_path=args.output,
                input_format=args.input_format,
                output_format=args.output_format,
                tokenizer=args.tokenizer == "segtok",
                chunk_size=args.chunk_size,
                label_name=args.label_name,
                return_probabilities_for_all_classes=args.all_probabilities,
                mini_batch_size=args.mini_batch_size,
                **launch,
            )
            print(f"{summary.predicted} predicted, {len(summary.skipped)} skipped, {summary.per_second:.1f}/s")
            for line, problem in summary.skipped:
                print(f"{args.input}:{line}: skipped ({problem})", file=sys.stderr)
            return 0
        result = _evaluate(model, args, launch)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    scores = {
        "main_score": result.main_score,
        **{
            " ".join(map(str, key)) if isinstance(key, tuple) else str(key): value
            for key, value in result.scores.items()
            if key != "loss" or args.loss  # without --loss flair's Result holds 0.0: no loss was computed
        },
    }
    print(json.dumps(scores, default=str) if args.json else result.detailed_results)
    if args.loss and not args.json:
        print(f"loss: {result.loss}")
    return 0
