"""Characters per second of flair's LanguageModelTrainer against FabricLanguageModelTrainer, one invocation:

    python benchmarks/language_model.py [--splits 2] [--out benchmarks/results]

Each configuration trains the same forward character LSTM (256 units, 64 columns in all, sequence length 100) for
one epoch on the same split files of the bundled Austen text, in a fresh process: flair's trainer with 2 torch
threads; ours in 1 process with 2 threads and with 1; ours on 2 forked processes with 1 thread each. Only the training
part is counted: the time spent in validation/test scoring and in flair's per-split ``generate_text`` is subtracted.
Writes ``language_model.json`` and ``language_model.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COLUMNS, SEQUENCE_LENGTH, HIDDEN = 64, 100, 256
CONFIGS = [  # name, trainer, processes, threads per process, columns per process, precision
    ("flair, 1 process, 2 threads", "flair", 1, 2, COLUMNS, "32-true"),
    ("flair-fabric, 1 process, 2 threads", "fabric", 1, 2, COLUMNS, "32-true"),
    ("flair-fabric, 1 process, 1 thread", "fabric", 1, 1, COLUMNS, "32-true"),
    ("flair-fabric, 2 processes, 1 thread each", "fabric", 2, 1, COLUMNS // 2, "32-true"),
    ("flair-fabric, 1 process, 1 thread, one rank's share", "fabric", 1, 1, COLUMNS // 2, "32-true"),
    ("flair-fabric, 2 processes, 1 thread each, 2x the columns", "fabric", 2, 1, COLUMNS, "32-true"),
    ("flair-fabric, 2 processes, 1 thread each, bf16-mixed", "fabric", 2, 1, COLUMNS // 2, "bf16-mixed"),
    ("bare loop, 1 process, 1 thread, one rank's share", "bare", 1, 1, COLUMNS // 2, "32-true"),
    ("bare loop, 2 processes, 1 thread each, no communication", "bare", 2, 1, COLUMNS // 2, "32-true"),
]
"""The bare loop: flair's training step (forward, loss, backward, clipping, SGD step) over this process's columns,
nothing else: no trainer, no DDP, no scoring. Two concurrent bare loops show what two processes cost on this machine
by themselves (shared caches and memory bandwidth)."""


def bare_loop(rank: int, processes: int, corpus_dir: Path, columns: int, port: int, out: Path) -> None:
    """One process of the bare loop over the epoch's split files; rank 0 writes the seconds of the loop."""
    import torch
    from flair.data import Dictionary
    from flair.models import LanguageModel
    from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus
    from torch.utils.data import DataLoader

    from flair_fabric.language_model.columns import rank_columns

    torch.set_num_threads(1)
    if processes > 1:  # a process group only to start the timed loops together
        address = f"tcp://127.0.0.1:{port}"
        torch.distributed.init_process_group("gloo", init_method=address, rank=rank, world_size=processes)
    dictionary = Dictionary.load_from_file(corpus_dir / "chars.pkl")
    corpus = TextCorpus(corpus_dir, dictionary, forward=True, character_level=True)
    torch.manual_seed(1)
    model = LanguageModel(dictionary, is_forward_lm=True, hidden_size=HIDDEN, nlayers=1, embedding_size=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)  # flair's LanguageModelTrainer default
    loss_function = torch.nn.CrossEntropyLoss()
    model.train()
    ntokens, loop = len(dictionary), 0.0
    for train_slice in DataLoader(corpus.train, shuffle=False, num_workers=0):
        if processes > 1:
            torch.distributed.barrier()
        started = time.perf_counter()
        data = rank_columns(train_slice.flatten(), columns, rank, processes)
        hidden = model.init_hidden(columns)
        for i in range(0, data.size(0) - 1, SEQUENCE_LENGTH):
            inputs, targets = LanguageModelTrainer._get_batch(data, i, SEQUENCE_LENGTH)
            model.zero_grad()
            optimizer.zero_grad()
            output, _, hidden = model(inputs, hidden)
            loss = loss_function(output.view(-1, ntokens), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            optimizer.step()
            hidden = LanguageModelTrainer._repackage_hidden(hidden)
        loop += time.perf_counter() - started
    if processes > 1:
        slowest = torch.tensor(loop)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        loop = float(slowest)
        torch.distributed.destroy_process_group()
    if rank == 0:
        seconds = {"scoring": 0.0, "generating": 0.0, "loop": loop, "total": loop}
        (out / "rank0.json").write_text(json.dumps(seconds))


def run_one(
    corpus_dir: Path, trainer_name: str, processes: int, threads: int, columns: int, precision: str, out: Path
) -> dict[str, float]:
    """In this (fresh) process: train one epoch, return the seconds spent in all, in scoring and in generating (and
    in the training loop, for flair-fabric and the bare loop)."""
    import torch

    if trainer_name == "bare":
        import socket

        import torch.multiprocessing

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        torch.multiprocessing.spawn(bare_loop, args=(processes, corpus_dir, columns, port, out), nprocs=processes)
        return json.loads((out / "rank0.json").read_text())
    from flair.data import Dictionary
    from flair.models import LanguageModel
    from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus

    from flair_fabric import FabricLanguageModelTrainer

    torch.set_num_threads(threads)
    spent = {"scoring": 0.0, "generating": 0.0}

    class TimedModel(LanguageModel):
        def generate_text(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super().generate_text(*args, **kwargs)
            finally:
                spent["generating"] += time.perf_counter() - started

    def timed_evaluate(self: Any, *args: Any) -> float:
        started = time.perf_counter()
        try:
            return base_class.evaluate(self, *args)
        finally:
            spent["scoring"] += time.perf_counter() - started

    base_class: Any = LanguageModelTrainer if trainer_name == "flair" else FabricLanguageModelTrainer
    timed_class = type("Timed", (base_class,), {"evaluate": timed_evaluate})
    if trainer_name == "fabric":
        from flair_fabric.language_model.loop import LanguageModelRun
        from flair_fabric.language_model.recurrent_kernels import recurrent_kernels

        spent["loop"] = 0.0

        class TimedRun(LanguageModelRun):
            def train_split(self, *args: Any) -> None:
                started = time.perf_counter()
                try:
                    super().train_split(*args)
                finally:
                    spent["loop"] += time.perf_counter() - started

        def train_on_rank(self: Any, fabric: Any, arguments: Any) -> None:
            started = time.perf_counter()
            with recurrent_kernels(fabric):  # as FabricLanguageModelTrainer.train_on_rank, with the loop timed
                TimedRun(self, fabric, arguments).run()
            if fabric.is_global_zero:
                (out / "rank0.json").write_text(json.dumps({**spent, "total": time.perf_counter() - started}))

        timed_class.train_on_rank = train_on_rank
    dictionary = Dictionary.load_from_file(corpus_dir / "chars.pkl")
    corpus = TextCorpus(corpus_dir, dictionary, forward=True, character_level=True)
    torch.manual_seed(1)
    model = TimedModel(dictionary, is_forward_lm=True, hidden_size=HIDDEN, nlayers=1, embedding_size=64)
    options: dict[str, Any] = {
        "sequence_length": SEQUENCE_LENGTH,
        "mini_batch_size": columns,
        "max_epochs": 1,
        "num_workers": 0,
    }
    started = time.perf_counter()
    if trainer_name == "flair":
        timed_class(model, corpus).train(out / "run", **options)
        return {**spent, "total": time.perf_counter() - started}
    strategy = "ddp_fork" if processes > 1 else "auto"
    timed_class(model, corpus).train(
        out / "run", accelerator="cpu", devices=processes, strategy=strategy, precision=precision, **options
    )
    return json.loads((out / "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, default=2, help="training split files used (of 16 cut from the text)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every configuration; medians are reported")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        corpus_dir, trainer_name, processes, threads, columns, precision, out = args.worker
        result = run_one(
            Path(corpus_dir), trainer_name, int(processes), int(threads), int(columns), precision, Path(out)
        )
        (Path(out) / "result.json").write_text(json.dumps(result))
        return

    sys.path.insert(0, str(REPO / "examples" / "language_model"))
    from prepare_corpus import prepare_corpus

    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as work:
        corpus_dir = Path(work) / "corpus"
        sizes = prepare_corpus(corpus_dir, splits=16)
        for extra in sorted((corpus_dir / "train").iterdir())[args.splits :]:
            extra.unlink()
        characters = sum(sizes[f"train/train_split_{number}"] for number in range(1, args.splits + 1))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in CONFIGS}
        for repeat in range(args.repeats):  # rounds of every configuration: drift hits each alike
            for name, trainer_name, processes, threads, columns, precision in CONFIGS:
                out = Path(work) / f"{repeat}-{trainer_name}-{processes}-{threads}-{columns}-{precision}"
                out.mkdir()
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
                command = [sys.executable, __file__, "--worker", str(corpus_dir), trainer_name, str(processes)]
                command += [str(threads), str(columns), precision, str(out)]
                subprocess.run(command, env=env, check=True, capture_output=True)
                seconds = json.loads((out / "result.json").read_text())
                training = seconds["total"] - seconds["scoring"] - seconds["generating"]
                runs[name].append({**seconds, "training": training})
                print(f"{name}: {characters / training:,.0f} characters/s ({training:.1f} s training)", flush=True)
    rows = []
    for name, measured in runs.items():
        training = statistics.median(run["training"] for run in measured)
        loop = statistics.median(run.get("loop", 0.0) for run in measured)
        rows.append(
            {
                "configuration": name,
                "runs": measured,
                "training": training,
                "chars_per_s": characters / training,
                "loop": loop,
                "loop_chars_per_s": characters / loop if loop else None,
            }
        )
    rate = {row["configuration"]: row["chars_per_s"] for row in rows}
    loop_rate = {row["configuration"]: row["loop_chars_per_s"] for row in rows if row["loop_chars_per_s"]}
    summary = {
        "fabric_1_process_vs_flair": rate[CONFIGS[1][0]] / rate[CONFIGS[0][0]],
        "scaling_efficiency_2_processes": rate[CONFIGS[3][0]] / (2 * rate[CONFIGS[2][0]]),
        "two_processes_vs_flair": rate[CONFIGS[3][0]] / rate[CONFIGS[0][0]],
        # the strong-scaling efficiency above, split into its two factors
        "half_the_columns_per_character": rate[CONFIGS[4][0]] / rate[CONFIGS[2][0]],
        "two_processes_vs_2x_one_ranks_share": rate[CONFIGS[3][0]] / (2 * rate[CONFIGS[4][0]]),
        "scaling_efficiency_2_processes_same_columns_per_process": rate[CONFIGS[5][0]] / (2 * rate[CONFIGS[2][0]]),
        "bf16_mixed_vs_32_true_2_processes": rate[CONFIGS[6][0]] / rate[CONFIGS[3][0]],
        # the training loop alone (split ends, set-up and the waits at their collectives left out)
        "loop_scaling_efficiency_2_processes": loop_rate[CONFIGS[3][0]] / (2 * loop_rate[CONFIGS[2][0]]),
        "bare_two_processes_vs_2x_one": loop_rate[CONFIGS[8][0]] / (2 * loop_rate[CONFIGS[7][0]]),
        "trainer_loop_vs_bare_loop_2_processes": loop_rate[CONFIGS[3][0]] / loop_rate[CONFIGS[8][0]],
    }
    machine = f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    report = {"started": started_at, "machine": machine, "characters": characters, "rows": rows, **summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "language_model.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Character language model: training characters per second",
        "",
        f"{started_at}, {machine}. One epoch over {args.splits} split files ({characters:,} characters) of the Austen"
        f" text; LSTM {HIDDEN} units, {COLUMNS} columns in all unless the row says otherwise, sequence length"
        f" {SEQUENCE_LENGTH}. Scoring and generated sample text are subtracted. Medians of {args.repeats} rounds.",
        "",
        "| configuration | training s | characters/s | loop alone s | characters/s in the loop |",
        "|---|---|---|---|---|",
        *[
            f"| {r['configuration']} | {r['training']:.1f} | {r['chars_per_s']:,.0f} | "
            + (f"{r['loop']:.1f} | {r['loop_chars_per_s']:,.0f} |" if r["loop"] else "- | - |")
            for r in rows
        ],
        "",
        f"flair-fabric on 1 process / flair: **{summary['fabric_1_process_vs_flair']:.3f}**; 2 processes / flair:"
        f" **{summary['two_processes_vs_flair']:.3f}**; 2-process scaling efficiency (against 2x one process with"
        f" one thread): **{summary['scaling_efficiency_2_processes']:.3f}**.",
        "",
        f"That efficiency is the product of two factors: one process with one rank's share ({COLUMNS // 2} columns)"
        f" trains **{summary['half_the_columns_per_character']:.3f}** as many characters per second as with"
        f" {COLUMNS} (smaller matrices per step), and 2 processes train **"
        f"{summary['two_processes_vs_2x_one_ranks_share']:.3f}** of twice that one-share rate (what running two"
        " processes costs: waiting for each other, communication, shared memory bandwidth). With mini_batch_size"
        f" kept per process ({COLUMNS} columns each, {2 * COLUMNS} in all), 2 processes reach **"
        f"{summary['scaling_efficiency_2_processes_same_columns_per_process']:.3f}** of twice one process.",
        "",
        f"bf16-mixed on 2 processes trains **{summary['bf16_mixed_vs_32_true_2_processes']:.3f}** as fast as 32-true"
        " (on a CPU without bfloat16 instructions the LSTM runs in float32 without oneDNN; see"
        " docs/language-model.md).",
        "",
        "The training loop alone (the time inside the splits' step loops on global rank 0: no set-up, no split ends"
        " and none of the waits at their collectives for the other rank's scoring and sample text): 2-process scaling"
        f" efficiency **{summary['loop_scaling_efficiency_2_processes']:.3f}**. Two bare loops (flair's step without"
        " a trainer and without communication) run concurrently at"
        f" **{summary['bare_two_processes_vs_2x_one']:.3f}** of twice one bare loop on one rank's share: what two"
        " processes cost on this machine by themselves. flair-fabric's 2-process loop trains"
        f" **{summary['trainer_loop_vs_bare_loop_2_processes']:.3f}** as fast as the two bare loops.",
    ]
    (args.out / "language_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
