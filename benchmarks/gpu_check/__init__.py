"""flair-fabric's prepared GPU check (issue 20), run as ``python benchmarks/gpu_check.py`` (see that entry point and
docs/gpu-check.md).

The modules, by job:

- ``cli``: the command line, and the hidden ``--worker``/``--probe`` modes of the processes the harness starts;
- ``harness``: the units in their own processes, ``--jobs`` at a time, within their budgets and the global one;
- ``processes``: a unit's environment, killing a process group, one probe in a fresh interpreter with a timeout;
- ``runner``: inside a unit's process: run its checks (or one probe) and write their rows;
- ``bootstrap``: the visible GPUs, ``--install-wheels`` (into /tmp/site) and the import check;
- ``settings``: paths, budgets, sizes, tolerances, the model; ``context``: checks, units, rows, the check context;
- ``training``, ``plugins``: what the checks share (data, models, the training call, measuring; TrainerPlugins);
- the checks by theme: ``parity``, ``precision``, ``strategies``, ``one_gpu``, ``throughput`` (and evaluation),
  ``language_model``; ``units``: every unit and probe, in report order;
- ``criteria``, ``report``: when each check passes, and ``gpu_check.json`` and ``README.md``.

The helpers the other benchmark scripts share (``free_port``, ``make_bert``, ``state_dict_difference``, the machine's
description) are in benchmarks/common.py.
"""
