"""Characters per second of flair's LanguageModelTrainer against FabricLanguageModelTrainer, one invocation:

    python benchmarks/language_model.py [--splits 2] [--repeats 3] [--only KEY,...] [--out benchmarks/results]

Each configuration trains the same forward character LSTM (256 units, 64 columns in all, sequence length 100) for
one epoch on the same split files of the bundled Austen text, in a fresh process: flair's trainer with 2 torch
threads; ours in 1 process with 2 threads and with 1; ours on 2 forked processes with 1 thread each; the same at
sequence length 250; and the bare training step (no trainer) in 1 and 2 processes, without and with DDP, to split the
2-process cost into what the machine, DDP's all-reduce and the trainer each take. Only the training part is counted:
the time spent in validation/test scoring and in flair's per-split ``generate_text`` is subtracted. Writes
``language_model.json`` and ``language_model.md`` into ``--out``; ``--only KEY,...`` runs some configurations.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COLUMNS, SEQUENCE_LENGTH, HIDDEN = 64, 100, 256
LONG_SEQUENCE = 250  # the sequence length of flair's tutorial and of the example


@dataclass(frozen=True)
class Config:
    """One measured configuration: the trainer (flair, fabric, or the bare loop without or with DDP), processes,
    torch threads per process, columns per process, precision and sequence length."""

    key: str
    name: str
    trainer: str
    processes: int
    threads: int
    columns: int
    precision: str = "32-true"
    sequence_length: int = SEQUENCE_LENGTH


HALF, BF16 = COLUMNS // 2, "bf16-mixed"
CONFIGS = [
    Config("flair", "flair, 1 process, 2 threads", "flair", 1, 2, COLUMNS),
    Config("fabric_1p2t", "flair-fabric, 1 process, 2 threads", "fabric", 1, 2, COLUMNS),
    Config("fabric_1p1t", "flair-fabric, 1 process, 1 thread", "fabric", 1, 1, COLUMNS),
    Config("fabric_2p", "flair-fabric, 2 processes, 1 thread each", "fabric", 2, 1, HALF),
    Config("fabric_1p1t_share", "flair-fabric, 1 process, 1 thread, one rank's share", "fabric", 1, 1, HALF),
    Config("fabric_2p_2x", "flair-fabric, 2 processes, 1 thread each, 2x the columns", "fabric", 2, 1, COLUMNS),
    Config("fabric_2p_bf16", "flair-fabric, 2 processes, 1 thread each, bf16-mixed", "fabric", 2, 1, HALF, BF16),
    Config("bare_1p_share", "bare loop, 1 process, 1 thread, one rank's share", "bare", 1, 1, HALF),
    Config("bare_2p", "bare loop, 2 processes, 1 thread each, no communication", "bare", 2, 1, HALF),
    Config("bare_2p_ddp", "bare loop, 2 processes, 1 thread each, DDP", "bare-ddp", 2, 1, HALF),
    Config(
        "fabric_1p1t_long",
        f"flair-fabric, 1 process, 1 thread, sequence length {LONG_SEQUENCE}",
        "fabric",
        1,
        1,
        COLUMNS,
        sequence_length=LONG_SEQUENCE,
    ),
    Config(
        "fabric_2p_long",
        f"flair-fabric, 2 processes, 1 thread each, sequence length {LONG_SEQUENCE}",
        "fabric",
        2,
        1,
        HALF,
        sequence_length=LONG_SEQUENCE,
    ),
]
"""The bare loop: flair's training step (forward, loss, backward, clipping, SGD step) over this process's columns,
nothing else: no trainer, no scoring, and no DDP unless asked for. Two concurrent bare loops show what two processes
cost on this machine by themselves (shared caches and memory bandwidth); with DDP (gloo, buckets as gradient views,
as flair-fabric wraps a language model) what the gradient all-reduce adds."""


def bare_loop(
    rank: int, processes: int, corpus_dir: Path, columns: int, port: int, out: Path, ddp: bool, sequence_length: int
) -> None:
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
    module = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True) if ddp else model
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
        for i in range(0, data.size(0) - 1, sequence_length):
            inputs, targets = LanguageModelTrainer._get_batch(data, i, sequence_length)
            model.zero_grad()
            optimizer.zero_grad()
            output, _, hidden = module(inputs, hidden)
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


def run_one(corpus_dir: Path, config: Config, out: Path) -> dict[str, float]:
    """In this (fresh) process: train one epoch, return the seconds spent in all, in scoring and in generating (and
    in the training loop, for flair-fabric and the bare loop)."""
    import torch

    trainer_name, processes, threads, columns = config.trainer, config.processes, config.threads, config.columns
    if trainer_name.startswith("bare"):
        import torch.multiprocessing
        from common import free_port

        port = free_port()
        ddp = trainer_name == "bare-ddp"
        arguments = (processes, corpus_dir, columns, port, out, ddp, config.sequence_length)
        torch.multiprocessing.spawn(bare_loop, args=arguments, nprocs=processes)
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
        from flair_fabric.language_model import job as language_model_job
        from flair_fabric.language_model.loop import LanguageModelRun

        spent["loop"] = 0.0

        class TimedRun(LanguageModelRun):
            def train_split(self, *args: Any) -> None:
                started = time.perf_counter()
                try:
                    super().train_split(*args)
                finally:
                    spent["loop"] += time.perf_counter() - started

            def run(self) -> None:  # the whole rank's run, as the trainer's job runs it (inside recurrent_kernels)
                started = time.perf_counter()
                super().run()
                if self.fabric.is_global_zero:
                    (out / "rank0.json").write_text(json.dumps({**spent, "total": time.perf_counter() - started}))

        language_model_job.LanguageModelRun = TimedRun  # type: ignore[misc]  # the job builds the run (forked too)
    dictionary = Dictionary.load_from_file(corpus_dir / "chars.pkl")
    corpus = TextCorpus(corpus_dir, dictionary, forward=True, character_level=True)
    torch.manual_seed(1)
    model = TimedModel(dictionary, is_forward_lm=True, hidden_size=HIDDEN, nlayers=1, embedding_size=64)
    options: dict[str, Any] = {
        "sequence_length": config.sequence_length,
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
        out / "run", accelerator="cpu", devices=processes, strategy=strategy, precision=config.precision, **options
    )
    return json.loads((out / "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, default=2, help="training split files used (of 16 cut from the text)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every configuration; medians are reported")
    parser.add_argument("--only", help="comma-separated configuration keys (default: all)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_key = {config.key: config for config in CONFIGS}
    if args.worker:
        corpus_dir, key, out = args.worker
        result = run_one(Path(corpus_dir), by_key[key], Path(out))
        (Path(out) / "result.json").write_text(json.dumps(result))
        return
    wanted = [key.strip() for key in args.only.split(",")] if args.only else list(by_key)
    unknown = sorted(set(wanted) - set(by_key))
    if unknown:
        parser.error(f"--only: unknown configuration(s) {', '.join(unknown)}; known: {', '.join(by_key)}")
    configs = [config for config in CONFIGS if config.key in wanted]

    sys.path.insert(0, str(REPO / "examples" / "language_model"))
    from prepare_corpus import prepare_corpus

    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as work:
        corpus_dir = Path(work) / "corpus"
        sizes = prepare_corpus(corpus_dir, splits=16)
        for extra in sorted((corpus_dir / "train").iterdir())[args.splits :]:
            extra.unlink()
        characters = sum(sizes[f"train/train_split_{number}"] for number in range(1, args.splits + 1))
        runs: dict[str, list[dict[str, float]]] = {config.key: [] for config in configs}
        for repeat in range(args.repeats):  # rounds of every configuration: drift hits each alike
            for config in configs:
                out = Path(work) / f"{repeat}-{config.key}"
                out.mkdir()
                threads = str(config.threads)
                env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
                command = [sys.executable, __file__, "--worker", str(corpus_dir), config.key, str(out)]
                subprocess.run(command, env=env, check=True, capture_output=True)
                seconds = json.loads((out / "result.json").read_text())
                training = seconds["total"] - seconds["scoring"] - seconds["generating"]
                runs[config.key].append({**seconds, "training": training})
                rate_now = f"{characters / training:,.0f} characters/s ({training:.1f} s training)"
                print(f"{config.name}: {rate_now}", flush=True)
    rows = []
    for config in configs:
        measured = runs[config.key]
        training = statistics.median(run["training"] for run in measured)
        loop = statistics.median(run.get("loop", 0.0) for run in measured)
        rows.append(
            {
                "key": config.key,
                "configuration": config.name,
                "runs": measured,
                "training": training,
                "chars_per_s": characters / training,
                "loop": loop,
                "loop_chars_per_s": characters / loop if loop else None,
            }
        )
    rate = {row["key"]: row["chars_per_s"] for row in rows}
    loop_rate = {row["key"]: row["loop_chars_per_s"] for row in rows if row["loop_chars_per_s"]}
    ratios = {  # name: (numerator, denominator, factor of the denominator, rates)
        "fabric_1_process_vs_flair": ("fabric_1p2t", "flair", 1, rate),
        "scaling_efficiency_2_processes": ("fabric_2p", "fabric_1p1t", 2, rate),
        "two_processes_vs_flair": ("fabric_2p", "flair", 1, rate),
        # the strong-scaling efficiency above, split into its two factors
        "half_the_columns_per_character": ("fabric_1p1t_share", "fabric_1p1t", 1, rate),
        "two_processes_vs_2x_one_ranks_share": ("fabric_2p", "fabric_1p1t_share", 2, rate),
        "scaling_efficiency_2_processes_same_columns_per_process": ("fabric_2p_2x", "fabric_1p1t", 2, rate),
        "bf16_mixed_vs_32_true_2_processes": ("fabric_2p_bf16", "fabric_2p", 1, rate),
        "scaling_efficiency_2_processes_long_sequences": ("fabric_2p_long", "fabric_1p1t_long", 2, rate),
        # the training loop alone (split ends, set-up and the waits at their collectives left out)
        "loop_scaling_efficiency_2_processes": ("fabric_2p", "fabric_1p1t", 2, loop_rate),
        "bare_two_processes_vs_2x_one": ("bare_2p", "bare_1p_share", 2, loop_rate),
        "bare_ddp_vs_bare_no_communication": ("bare_2p_ddp", "bare_2p", 1, loop_rate),
        "trainer_loop_vs_bare_ddp_loop_2_processes": ("fabric_2p", "bare_2p_ddp", 1, loop_rate),
    }
    summary = {
        name: rates[top] / (factor * rates[bottom])
        for name, (top, bottom, factor, rates) in ratios.items()
        if top in rates and bottom in rates
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
        f" {SEQUENCE_LENGTH} unless the row says otherwise. Scoring and generated sample text are subtracted. Medians"
        f" of {args.repeats} rounds. The loop alone: the time inside the splits' step loops on global rank 0 (no"
        " set-up, no split ends, none of the waits for the other rank's scoring).",
        "",
        "| configuration | training s | characters/s | loop alone s | characters/s in the loop |",
        "|---|---|---|---|---|",
        *[
            f"| {r['configuration']} | {r['training']:.1f} | {r['chars_per_s']:,.0f} | "
            + (f"{r['loop']:.1f} | {r['loop_chars_per_s']:,.0f} |" if r["loop"] else "- | - |")
            for r in rows
        ],
        "",
        "| ratio | value | what it is |",
        "|---|---|---|",
        *[
            f"| {name} | **{summary[name]:.3f}** | {top} / {'2 x ' if factor == 2 else ''}{bottom}"
            f"{' (loop alone)' if rates is loop_rate else ''} |"
            for name, (top, bottom, factor, rates) in ratios.items()
            if name in summary
        ],
    ]
    (args.out / "language_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(summary) - 2 :]))


if __name__ == "__main__":
    main()
