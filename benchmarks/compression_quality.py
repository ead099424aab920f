"""What gradient compression costs in quality and saves in time on the demo task, one invocation:

    python benchmarks/compression_quality.py [--seeds 1 2 3] [--out benchmarks/results]

``examples/demo_trec.py`` (all-MiniLM-L6-v2 fine-tuned on TREC-6, 2 CPU processes) once per seed with exact DDP,
``bf16`` compression, interleaved. (PowerSGD is refused for this model: its pooler gets no gradient, and
PowerSGD with ``find_unused_parameters=True`` puts the ranks' collectives out of step.) Reports the final dev and
test accuracy and the wall time of each run. Writes ``compression_quality.json`` and ``compression_quality.md``
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo_trec.py"
VARIANTS = ("exact", "bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = str(REPO)
    env.pop("LOCAL_RANK", None)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            order = VARIANTS if seed % 2 else VARIANTS[::-1]
            for variant in order:
                summary = Path(work) / f"{variant}-{seed}.json"
                command = [sys.executable, str(DEMO), "--seed", str(seed), "--epochs", str(args.epochs)]
                command += ["--output", str(Path(work) / f"{variant}-{seed}"), "--summary-json", str(summary)]
                if variant != "exact":
                    command += ["--gradient-compression", variant]
                subprocess.run(command, env=env, check=True, capture_output=True, text=True)
                row = {"variant": variant, **json.loads(summary.read_text())}
                rows.append(row)
                print(
                    f"seed {seed} {variant}: dev {row['dev_score']:.4f} test {row['test_score']:.4f}"
                    f" {row['seconds']:.1f} s",
                    flush=True,
                )
    summary_rows = {}
    for variant in VARIANTS:
        mine = [row for row in rows if row["variant"] == variant]
        summary_rows[variant] = {
            "mean_dev_score": statistics.mean(row["dev_score"] for row in mine),
            "mean_test_score": statistics.mean(row["test_score"] for row in mine),
            "median_seconds": statistics.median(row["seconds"] for row in mine),
        }
    exact = summary_rows["exact"]
    report = {"started": started_at, "epochs": args.epochs, "seeds": args.seeds, "rows": rows, "summary": summary_rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression_quality.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Gradient compression on the demo task",
        "",
        f"{started_at}; `examples/demo_trec.py`, MiniLM-L6 fine-tuned on TREC-6 (1,200 training, 200 dev, 500 test"
        f" questions), {args.epochs} epochs, 2 CPU processes with 1 thread each; seeds {args.seeds}. Time: the whole"
        " run (start-up, training, dev evaluation, final test).",
        "",
        "| gradients | dev accuracy per seed | mean dev | mean test | mean test - exact | median s | time / exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, values in summary_rows.items():
        per_seed = ", ".join(f"{row['dev_score']:.3f}" for row in rows if row["variant"] == variant)
        lines.append(
            f"| {variant} | {per_seed} | {values['mean_dev_score']:.4f} | {values['mean_test_score']:.4f} |"
            f" {values['mean_test_score'] - exact['mean_test_score']:+.4f} | {values['median_seconds']:.1f} |"
            f" {values['median_seconds'] / exact['median_seconds']:.3f} |"
        )
    (args.out / "compression_quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-4:]))


if __name__ == "__main__":
    main()
