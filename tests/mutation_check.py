"""The mutation check (``make mutation-check``): plant each deliberate bug below in a copy of the repository, one at a
time, run only the tests that should catch it, and report caught or survived. Every bug must be caught.

Each mutation names the claim it breaks. Add one for every distributed behaviour you add: a test earns its place by
failing when the code is wrong. Results go to ``benchmarks/results/mutation_check.{json,md}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Mutation:
    """A deliberate bug: ``edits`` (file, text, replacement; each text occurs exactly once) and the tests that must
    catch it."""

    name: str
    claim: str
    edits: list[tuple[str, str, str]]
    tests: list[str] = field(default_factory=list)


MUTATIONS = [
    Mutation(
        "own shuffle seed per rank",
        "every data point once per epoch across ranks",
        [
            (
                "flair_fabric/training/sampling.py",
                "return int(fabric.broadcast(seed, src=0))",
                "return int(torch.randint(0, 2**31 - 1, (1,)).item())",
            )
        ],
        [
            "tests/strategies/test_ddp.py::test_ranks_with_different_random_states_still_read_every_data_point_once_per_epoch"
        ],
    ),
    Mutation(
        "train loss = mean of the ranks' means",
        "sample-weighted global train loss",
        [
            (
                "flair_fabric/training/run.py",
                "agreed = self.lockstep.agree(loss.loss_sum, float(loss.data_points))",
                "agreed = self.lockstep.agree(loss.mean(), 1.0)",
            )
        ],
        ["tests/training/test_every_model.py", "-k", "union and text_missing_labels"],
    ),
    Mutation(
        "resume on another world size skips model and optimizer",
        "model, optimizer and schedules continue",
        [
            (
                "flair_fabric/state/training_state.py",
                '    load_model_and_optimizer(fabric, folder / "state.ckpt", module, optimizer)',
                "    if progress.world_size == fabric.world_size:\n"
                '        load_model_and_optimizer(fabric, folder / "state.ckpt", module, optimizer)',
            )
        ],
        ["tests/state/test_resume.py::test_a_checkpoint_of_one_process_resumes_on_two"],
    ),
    Mutation(
        "flair.device never set from Fabric",
        "each rank computes on its own device",
        [
            ("flair_fabric/launch/workers.py", "    flair.device = fabric.device\n    relaunched", "    relaunched"),
            (
                "flair_fabric/launch/workers.py",
                "        flair.device = fabric.device  # before the job",
                "        pass  # before the job",
            ),
        ],
        ["tests/launch/test_launching.py::test_every_rank_computes_on_the_device_fabric_gives_it"],
    ),
    Mutation(
        "Fabric always built with 32-true",
        "bf16-mixed / use_amp mapping",
        [("flair_fabric/launch/config.py", "precision=config.precision,", 'precision="32-true",')],
        ["tests/training/test_parity.py", "-k", "bf16"],
    ),
    Mutation(
        "both failure guards removed",
        "no hang, no orphans when a rank dies",
        [
            (
                "flair_fabric/launch/failures.py",
                "    launcher = fabric.strategy.launcher\n",
                "    return\n    launcher = fabric.strategy.launcher\n",
            ),
            (
                "flair_fabric/launch/failures.py",
                "    parent = os.getppid()\n",
                "    return\n    parent = os.getppid()\n",
            ),
        ],
        ["tests/distributed/test_reliability.py", "-k", "rank0-raises-rank1-stopped or rank0-dies-rank1-stalls"],
    ),
    Mutation(
        "loss not scaled by the world size",
        "gradients equal one process on the union (fsdp too, clipping off)",
        [
            (
                "flair_fabric/training/step.py",
                "trainer._backward(loss * fabric.world_size if fabric.world_size > 1 else loss)",
                "trainer._backward(loss)",
            )
        ],
        ["tests/training/test_every_model.py", "-k", "chunks and fsdp and text_missing_labels"],
    ),
    Mutation(
        "a step that learns nothing does not take part",
        "no rank stalls the others (relation extraction, entity linking)",
        [
            (
                "flair_fabric/training/run.py",
                "self.participation = Participation(trainer.model, stand_in) if fabric.world_size > 1 else None",
                "self.participation = None",
            )
        ],
        ["tests/training/test_every_model.py", "-k", "union and relation_extractor"],
    ),
    Mutation(
        "ranks cut different numbers of chunks",
        "every rank runs as many passes per step (fsdp collectives pair up)",
        [
            (
                "flair_fabric/training/participation.py",
                "    return chunks + [[] for _ in",
                "    return chunks or [[] for _ in",
            )
        ],
        ["tests/training/test_every_model.py", "-k", "chunks and fsdp and span"],
    ),
    Mutation(
        "the fsdp root reshards after forward",
        "a step that learns nothing gathers the root's parameters as often as the others",
        [
            (
                "flair_fabric/strategies/fsdp.py",
                'fully_shard(model, **{**options, "reshard_after_forward": False})',
                "fully_shard(model, **options)",
            )
        ],
        ["tests/training/test_every_model.py", "-k", "chunks and fsdp and relation_extractor"],
    ),
    Mutation(
        "rank-0-only work waits on the short timeout",
        "slow saves and rank-0 evaluation do not trip collective_timeout",
        [("flair_fabric/distributed/stalls.py", "    if fabric.world_size == 1 or not", "    if True or not")],
        ["tests/distributed/test_reliability.py::test_work_of_rank_zero_alone_does_not_trip_the_collective_timeout"],
    ),
    Mutation(
        "a timed-out collective is not explained",
        "the error says which rank, epoch, step and phase",
        [("flair_fabric/distributed/stalls.py", "        if not is_timeout(error) or", "        if True or")],
        [
            "tests/distributed/test_reliability.py::test_a_stalled_rank_ends_the_job_after_the_collective_timeout_with_an_error_that_says_where"
        ],
    ),
    Mutation(
        "collective_timeout not given to the strategy",
        "collective_timeout reaches the process group",
        [
            (
                "flair_fabric/launch/config.py",
                "start_method=_START_METHOD[name], timeout=timeout, find_unused",
                "start_method=_START_METHOD[name], find_unused",
            )
        ],
        ["tests/training/test_arguments.py", "-k", "collective_timeout_reaches"],
    ),
    Mutation(
        "the caller's model stays in train mode",
        "the model comes back from workers as flair leaves it",
        [("flair_fabric/training/in_workers.py", "        model.train(self.training)", "        pass")],
        ["tests/training/test_every_model.py", "-k", "union and text]"],
    ),
    Mutation(
        "the caller's model gets no model card",
        "the model comes back from workers as flair leaves it",
        [("flair_fabric/training/in_workers.py", "        model.model_card = self.model_card\n", "")],
        ["tests/training/test_every_model.py", "-k", "union and text]"],
    ),
    Mutation(
        "a Ctrl-C to the caller alone is not passed on",
        "an interrupt to a notebook kernel stops every worker",
        [
            (
                "flair_fabric/launch/workers.py",
                "        send(FORWARDED_SIGNAL)",
                "        pass",
            )
        ],
        ["tests/launch/test_notebooks.py", "-k", "kernel-mid-epoch-1"],
    ),
    Mutation(
        "stopped workers are not reaped",
        "no worker is left after two interrupts, not even a zombie",
        [("flair_fabric/launch/workers.py", "    deadline = time.monotonic() + grace_seconds\n", "    return 0\n")],
        ["tests/launch/test_notebooks.py", "-k", "kernel-mid-epoch-2"],
    ),
    Mutation(
        "every rank prints Lightning's banner",
        "one banner in a notebook",
        [
            (
                "flair_fabric/launch/environment.py",
                '        return not message.startswith("Initializing',
                '        return True or message.startswith("Initializing',
            )
        ],
        ["tests/launch/test_notebooks.py", "-k", "gets_the_model_back"],
    ),
    Mutation(
        "ddp_spawn is not refused in a notebook",
        "spawn in a notebook gets our error before anything is created",
        [
            (
                "flair_fabric/launch/config.py",
                '    if strategy.start_method == "spawn" and launched is None',
                "    if False and launched is None",
            )
        ],
        ["tests/launch/test_notebooks.py", "-k", "gets_the_model_back"],
    ),
    Mutation(
        "the rendezvous of a one-machine run listens on every interface",
        "loopback only",
        [
            (
                "flair_fabric/launch/workers.py",
                "    return (\n        isinstance(strategy, LAUNCHING_STRATEGIES)",
                "    return False and (\n        isinstance(strategy, LAUNCHING_STRATEGIES)",
            )
        ],
        ["tests/launch/test_launching.py", "-k", "spawn_and_fork and fork"],
    ),
    Mutation(
        "checkpoint files unpickled as they come",
        "checkpoints load data, never code",
        [
            (
                "flair_fabric/state/safe_loading.py",
                'map_location="cpu", weights_only=True)',
                'map_location="cpu", weights_only=False)',
            )
        ],
        ["tests/state/test_resume.py", "-k", "tampered and ddp"],
    ),
    Mutation(
        "a sharded checkpoint's metadata is not checked",
        "checkpoints load data, never code (fsdp)",
        [("flair_fabric/state/training_state.py", "        check_distributed_checkpoint(state)", "        pass")],
        ["tests/state/test_resume.py", "-k", "tampered and fsdp"],
    ),
    Mutation(
        "checkpoints keep the umask's permissions",
        "checkpoint files are private to the user",
        [("flair_fabric/state/training_state.py", "        _make_private(temporary)\n", "")],
        ["tests/state/test_resume.py", "-k", "tampered and ddp"],
    ),
    Mutation(
        "evaluation batches not dealt round robin",
        "sharded evaluation predicts each point once, on every rank",
        [("flair_fabric/evaluation/sharded.py", "if number % world_size == rank", "if rank == 0")],
        ["tests/evaluation/test_sharded_evaluation.py", "-k", "predicts_each_data_point_once"],
    ),
    Mutation(
        "ranks' corpora and models not compared",
        "ranks that would train different things are refused",
        [
            (
                "flair_fabric/distributed/fingerprints.py",
                "    if fabric.world_size == 1:\n        return\n    mine",
                "    return\n    mine",
            )
        ],
        ["tests/distributed/test_reliability.py", "-k", "different_things and labels"],
    ),
    Mutation(
        "the launch path does not stop relaunched ranks when rank 0 raises",
        "flair_fabric.evaluate and training share the guards: nothing left running",
        [
            (
                "flair_fabric/launch/workers.py",
                "                stop_started_processes(fabric)  #",
                "                pass  #",
            )
        ],
        ["tests/evaluation/test_sharded_evaluation.py", "-k", "relaunch_ends"],
    ),
    Mutation(
        "the engine-clipping flag is ignored (the loop clips under every strategy but never with DDP)",
        "gradient clipping as flair does it",
        [
            (
                "flair_fabric/training/step.py",
                "if a.max_grad_norm is not None and not run.strategy.clips_gradients_in_engine:",
                "if a.max_grad_norm is not None and run.strategy.clips_gradients_in_engine:",
            )
        ],
        ["tests/training/test_parity.py", "-k", "matches_flair"],
    ),
    Mutation(
        "a resumed epoch starts again from its first batch",
        "exact mid-epoch resume that reads and embeds only the unseen batches",
        [
            (
                "flair_fabric/training/run.py",
                "first_step=point.step_in_epoch if resumed and point and point.same_processes else 0,",
                "first_step=0,",
            )
        ],
        ["tests/state/test_preemption.py", "-k", "killed_mid_epoch and ddp"],
    ),
    Mutation(
        "the epoch's order is not drawn again from the saved generators",
        "exact mid-epoch resume in one process (flair's loader)",
        [
            (
                "flair_fabric/training/checkpointing.py",
                '            set_rng_state(mine["epoch_start_rng"])',
                "            pass",
            )
        ],
        ["tests/state/test_preemption.py", "-k", "killed_mid_epoch and one"],
    ),
    Mutation(
        "the epoch's loss so far is not restored",
        "the same loss.tsv after a mid-epoch resume",
        [
            (
                "flair_fabric/training/checkpointing.py",
                '            epoch_loss.add(torch.tensor(mine["loss_sum"]), int(mine["data_points"]))',
                "            pass",
            )
        ],
        ["tests/state/test_preemption.py", "-k", "killed_mid_epoch and ddp"],
    ),
    Mutation(
        "retention keeps one checkpoint too many",
        "keep_checkpoints keeps the newest k",
        [
            (
                "flair_fabric/state/training_state.py",
                "complete_checkpoints(base_path)[:-keep]",
                "complete_checkpoints(base_path)[: -keep - 1]",
            )
        ],
        ["tests/state/test_preemption.py", "-k", "retention"],
    ),
    Mutation(
        "rank 0's clock never asks for a checkpoint",
        "checkpoints every n minutes",
        [
            (
                "flair_fabric/training/checkpointing.py",
                "            self.run.lockstep.request_checkpoint()",
                "            pass",
            )
        ],
        ["tests/state/test_preemption.py", "-k", "by_time"],
    ),
    Mutation(
        "the longer shard's last point is not folded in",
        "every point once, same number of steps on every rank",
        [
            (
                "flair_fabric/training/sampling.py",
                "        last = batches.pop()\n        batches[-1] = batches[-1] + last",
                "        pass",
            )
        ],
        ["tests/training/test_sampling.py"],
    ),
    Mutation(
        "forked workers keep the caller's threads",
        "forked workers finish after the caller computed on several threads (OpenMP is not fork-safe)",
        [("flair_fabric/launch/workers.py", "        one_cpu_thread_after_fork()\n", "        pass\n")],
        ["tests/launch/test_launching.py", "-k", "forked_workers_after and 1"],
    ),
    Mutation(
        "language model: every rank trains the first columns",
        "N ranks with b columns train as one process with N*b",
        [
            (
                "flair_fabric/language_model/columns.py",
                "columns[:, rank * per_rank : (rank + 1) * per_rank]",
                "columns[:, 0:per_rank]",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "two_processes and ddp_fork"],
    ),
    Mutation(
        "language model: validation loss of rank 0's columns only",
        "validation perplexity across the ranks equals one process's",
        [
            (
                "flair_fabric/language_model/loop.py",
                'return float(cast(torch.Tensor, self.fabric.all_reduce(total, reduce_op="mean")).item())',
                "return rank_loss",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "two_processes and ddp_fork"],
    ),
    Mutation(
        "language model: ranks start from their own generators",
        "the ranks read the text as one process does (same shuffles and case flips)",
        [
            (
                "flair_fabric/language_model/loop.py",
                "        start_from_the_callers_generators(fabric, a.generators)\n",
                "",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "two_processes and ddp_fork"],
    ),
    Mutation(
        "language model: the caller's model is not updated after fork/spawn",
        "the caller's model holds the trained weights",
        [("flair_fabric/language_model/trainer.py", "        self.model.load_state_dict(trained.weights)\n", "")],
        ["tests/language_model/test_language_model_trainer.py", "-k", "two_processes and ddp_fork"],
    ),
    Mutation(
        "language model: resume keeps the generators of the skipped reads",
        "a killed run resumes to the uninterrupted result",
        [
            (
                "flair_fabric/language_model/loop.py",
                'set_rng_state(cast(dict[str, Any], resumed)["generators"])',
                "pass",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "killed"],
    ),
    Mutation(
        "language model: resume draws a new file order for the epoch",
        "a killed run resumes to the uninterrupted result",
        [("flair_fabric/language_model/loop.py", '            set_rng_state(resumed["epoch_generators"])\n', "")],
        ["tests/language_model/test_language_model_trainer.py", "-k", "killed"],
    ),
    Mutation(
        "language model: oneDNN's bfloat16 LSTM on every CPU",
        "bf16-mixed trains on a CPU without bfloat16 instructions",
        [
            (
                "flair_fabric/language_model/recurrent_kernels.py",
                "return not torch.ops.mkldnn._is_mkldnn_bf16_supported()",
                "return False",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "bf16_mixed"],
    ),
    Mutation(
        "optimizer: steps one parameter at a time (flair's CPU default)",
        "the optimizer step is grouped (foreach) by default, bit-equal",
        [
            (
                "flair_fabric/training/optimizer_implementation.py",
                'options = {**options, "foreach": True}',
                "options = dict(options)",
            )
        ],
        ["tests/training/test_optimizer_implementation.py"],
    ),
    Mutation(
        "optimizer: grouped step for any optimizer class",
        "a subclass (which may override step) is built as flair builds it",
        [
            (
                "flair_fabric/training/optimizer_implementation.py",
                "if optimizer_class in GROUPED_STEP_OPTIMIZERS and",
                "if issubclass(optimizer_class, GROUPED_STEP_OPTIMIZERS) and",
            )
        ],
        ["tests/training/test_optimizer_implementation.py"],
    ),
    Mutation(
        "predict: rank 0 keeps only its own batches' labels",
        "every data point gets the labels flair's predict gives it",
        [
            (
                "flair_fabric/prediction/sharding.py",
                "            put_labels(data_points[index], labels)\n",
                "            pass\n",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "relaunched"],
    ),
    Mutation(
        "predict: forked workers' labels stay in the workers",
        "the caller's data points get the labels",
        [("flair_fabric/prediction/api.py", "        _put_labels(data_points, predicted)\n", "        pass\n")],
        ["tests/prediction/test_predict.py", "-k", "in_memory and text"],
    ),
    Mutation(
        "predict: a chunk's records written out of input order",
        "streamed output in input order",
        [
            (
                "flair_fabric/prediction/api.py",
                "                for record in chunk:\n",
                "                for record in reversed(chunk):\n",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "20000"],
    ),
    Mutation(
        "predict: the output written in place",
        "a killed job leaves no output file",
        [
            (
                "flair_fabric/prediction/api.py",
                "        write_atomically(stream.out_path, predict_all)",
                "        predict_all(str(stream.out_path))",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "killed"],
    ),
    Mutation(
        "DDP: the compression hook is never registered",
        "gradient_compression changes what is all-reduced",
        [
            (
                "flair_fabric/strategies/ddp.py",
                "        register_compression(wrapped, self.gradient_compression, self.powersgd_options)\n",
                "",
            )
        ],
        ["tests/strategies/test_compression.py", "-k", "bf16"],
    ),
    Mutation(
        "DDP: half-precision compression sums instead of averaging",
        "compressed ranks stay close to exact DDP",
        [
            (
                "flair_fabric/strategies/compression.py",
                "compressed = buffer.to(dtype).div_(dist.get_world_size(group))",
                "compressed = buffer.to(dtype)",
            )
        ],
        ["tests/strategies/test_compression.py", "-k", "fp16"],
    ),
    Mutation(
        "DDP: PowerSGD's buckets in flight together",
        "PowerSGD over several buckets keeps the ranks' collectives in step",
        [
            (
                "flair_fabric/strategies/compression.py",
                "    if state.previous is not None:\n        state.previous.wait()\n",
                "",
            )
        ],
        ["tests/strategies/test_compression.py", "-k", "several_buckets"],
    ),
    Mutation(
        "DDP: PowerSGD allowed with unused parameters",
        "PowerSGD with unused parameters is refused with the reason",
        [
            (
                "flair_fabric/strategies/ddp.py",
                'if self.gradient_compression == "powersgd" and self.find_unused_parameters:',
                "if False:",
            )
        ],
        ["tests/strategies/test_compression.py", "-k", "unused"],
    ),
    Mutation(
        "predict: label addresses come back from JSON as lists",
        "labels cross to the caller as JSON unchanged",
        [
            (
                "flair_fabric/prediction/sharding.py",
                "    return tuple(_as_address(part)",
                "    return list(_as_address(part)",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "json"],
    ),
    Mutation(
        "predict: labels with metadata sent as JSON",
        "labels that carry metadata cross as objects",
        [
            (
                "flair_fabric/prediction/sharding.py",
                "        if any(label.metadata for each",
                "        if False and any(label.metadata for each",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "json"],
    ),
    Mutation(
        "predict: an unsplittable model ends the run",
        "a model whose labels cannot move is predicted by the caller",
        [
            (
                "flair_fabric/prediction/api.py",
                "            return NotSplit(str(error))",
                "            raise",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "cannot_move"],
    ),
    Mutation(
        "predict: a rank's unsplittable labels not agreed on",
        "every rank falls back together",
        [
            (
                "flair_fabric/prediction/sharding.py",
                "    problem = _agreed_problem(fabric, problem)\n",
                "",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "cannot_move"],
    ),
    Mutation(
        "predict: a progress bar on every rank",
        "one progress bar, on global rank 0",
        [
            (
                "flair_fabric/prediction/api.py",
                "disable=not (fabric.is_global_zero and stream.progress_bar)",
                "disable=not stream.progress_bar",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "progress_bar"],
    ),
    Mutation(
        "predict: the progress bar counts this rank's share only",
        "the progress bar counts every rank's data points",
        [
            (
                "flair_fabric/prediction/api.py",
                "                bar.update(len(sentences))",
                "                bar.update(len(sentences[fabric.global_rank :: fabric.world_size]))",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "progress_bar"],
    ),
    Mutation(
        "predict: the whole input file read at once",
        "memory per rank stays flat as the input grows",
        [
            (
                "flair_fabric/prediction/api.py",
                "    records = _records(stream)\n",
                "    records = iter(list(_records(stream)))\n",
            )
        ],
        ["tests/prediction/test_predict.py", "-k", "memory_per_rank"],
    ),
    Mutation(
        "language model: each rank scores its own held-out text",
        "validation and test perplexity of global rank 0's text, as in one process",
        [
            (
                "flair_fabric/language_model/loop.py",
                "return cast(tuple[torch.Tensor, torch.Tensor], self.fabric.broadcast(held_out, src=0))",
                "return held_out",
            )
        ],
        ["tests/language_model/test_language_model_trainer.py", "-k", "script_relaunch"],
    ),
    Mutation(
        "balance: lengths never reach the sampler",
        "each step's data points are dealt to the ranks by length by default",
        [("flair_fabric/training/run.py", "            lengths=self.lengths,\n", "")],
        ["tests/strategies/test_ddp.py", "-k", "balanced_steps"],
    ),
    Mutation(
        "balance: equal hands (longest first, round robin)",
        "the rank with the longest sentences gets fewer: least padding of the slowest rank",
        [
            (
                "flair_fabric/training/balancing.py",
                "    hands, start = [], 0\n    for size in sizes:\n",
                "    sizes = [total // ranks + (r < total % ranks) for r in range(ranks)]\n"
                "    longest_first = longest_first[0::2] + longest_first[1::2] if ranks == 2 else longest_first\n"
                "    hands, start = [], 0\n    for size in sizes:\n",
            )
        ],
        ["tests/training/test_sampling.py", "-k", "dealing_by_length"],
    ),
    Mutation(
        "balance: a step's data points drawn from the whole epoch",
        "every step trains the data points of the strided step (resume positions, the same gradient)",
        [
            (
                "flair_fabric/training/balancing.py",
                "        step = order[offset : offset + size]\n",
                "        step = list(order)[offset::len(step_sizes)][:size]\n",
            )
        ],
        ["tests/training/test_sampling.py", "-k", "dealing_by_length"],
    ),
    Mutation(
        "balance: also under FSDP",
        "sharded strategies keep strided shards (FSDP's collectives need batches alike)",
        [
            (
                "flair_fabric/training/run.py",
                "self.arguments.balance_batches and keeps_whole_model(fabric.strategy)",
                "self.arguments.balance_batches",
            )
        ],
        ["tests/strategies/test_fsdp.py", "-k", "forked_workers_and_a_user_policy"],
    ),
    Mutation(
        "balance: hands ignore the chunk capacity",
        "with mini_batch_chunk_size no rank runs more chunks than strided batches need",
        [
            (
                "flair_fabric/training/sampling.py",
                "math.ceil(max(sizes) / chunk_size) * chunk_size if chunk_size else total - world_size + 1",
                "total - world_size + 1",
            )
        ],
        ["tests/training/test_sampling.py", "-k", "dealing_by_length"],
    ),
    Mutation(
        "Fabric detects the cluster itself (initialises MPI wherever mpi4py is installed)",
        "a run survives an mpi4py without an MPI launcher",
        [
            (
                "flair_fabric/launch/config.py",
                "plugins=None if own else [cluster_environment()],",
                "plugins=None,",
            )
        ],
        ["tests/launch/test_mpi_detection.py::test_training_with_mpi4py_installed_but_no_mpi_launcher"],
    ),
    Mutation(
        "precision is resolved with Fabric's own cluster detection",
        "a run survives an mpi4py without an MPI launcher",
        [
            (
                "flair_fabric/launch/config.py",
                "plugins=[LightningEnvironment()],  # one local process",
                "plugins=None,  # one local process",
            )
        ],
        ["tests/launch/test_mpi_detection.py::test_training_with_mpi4py_installed_but_no_mpi_launcher"],
    ),
    Mutation(
        "MPI asked without an MPI launcher",
        "MPIEnvironment only for processes mpirun started",
        [
            (
                "flair_fabric/launch/environment.py",
                "if started_by_mpi_launcher() and MPIEnvironment.detect():",
                "if MPIEnvironment.detect():",
            )
        ],
        ["tests/launch/test_mpi_detection.py"],
    ),
    Mutation(
        "FSDP's gathered model leaves buffers where the model was built",
        "the evaluating model holds every tensor on the rank's device (a model built on the CPU, trained on a GPU)",
        [
            (
                "flair_fabric/strategies/fsdp.py",
                "                setattr(module, name, value.detach().to(flair.device))\n",
                "                if qualified in weights:\n                    buffer.data.copy_(value)\n",
            )
        ],
        ["tests/strategies/test_fsdp.py", "-k", "gathered_model"],
    ),
    Mutation(
        "ddp_fork on the GPU after the CUDA driver was initialised",
        "forking GPU workers is refused when they cannot use the GPU, with the fix in the message",
        [
            (
                "flair_fabric/launch/config.py",
                'if strategy.start_method == "fork" and accelerator == "cuda" and cuda_driver_initialized():',
                'if strategy.start_method == "fork" and accelerator == "cuda" and cuda_is_initialized():',
            )
        ],
        ["tests/launch/test_config.py", "-k", "driver"],
    ),
    Mutation(
        "flair imported before the NVML-based CUDA check is set",
        "importing flair_fabric first keeps the CUDA driver uninitialised (ddp_fork works in a notebook)",
        [("flair_fabric/__init__.py", 'os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")\n', "")],
        ["tests/launch/test_config.py", "-k", "flair_fabric_first"],
    ),
]


def _copy_repository(target: Path) -> None:
    ignored = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "runs"
    )
    shutil.copytree(REPO, target, ignore=ignored)


def _apply(root: Path, mutation: Mutation) -> None:
    for relative, text, replacement in mutation.edits:
        path = root / relative
        source = path.read_text()
        if source.count(text) != 1:
            raise SystemExit(f"mutation {mutation.name!r}: {text!r} occurs {source.count(text)} times in {relative}")
        path.write_text(source.replace(text, replacement))


def run(selected: list[str]) -> int:
    """Run the mutations whose name contains one of ``selected`` (all if empty); 0 if every one was caught."""
    rows = []
    for mutation in MUTATIONS:
        if selected and not any(word in mutation.name for word in selected):
            continue
        with tempfile.TemporaryDirectory(prefix="flair-fabric-mutation-") as folder:
            root = Path(folder) / "repo"
            _copy_repository(root)
            _apply(root, mutation)
            env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            started = time.monotonic()
            command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout=300"]
            try:
                completed = subprocess.run(
                    [*command, *mutation.tests], cwd=root, env=env, capture_output=True, text=True, timeout=900
                )
                caught = completed.returncode != 0
                tail = (completed.stdout + completed.stderr).strip().splitlines()[-1:]
            except subprocess.TimeoutExpired:
                caught, tail = True, ["the tests did not end within 900 s (a hang counts as caught)"]
        seconds = time.monotonic() - started
        rows.append({"mutation": mutation.name, "claim": mutation.claim, "caught": caught, "seconds": round(seconds)})
        print(f"{'caught  ' if caught else 'SURVIVED'} {seconds:5.0f} s  {mutation.name}: {' '.join(tail)}", flush=True)
    caught = sum(row["caught"] for row in rows)
    print(f"\n{caught} of {len(rows)} deliberate bugs caught")
    if not selected:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "mutation_check.json").write_text(json.dumps(rows, indent=2) + "\n")
        table = ["| deliberate bug | claim it breaks | caught | seconds |", "|---|---|---|---|"]
        table += [
            f"| {r['mutation']} | {r['claim']} | {'yes' if r['caught'] else '**no**'} | {r['seconds']} |" for r in rows
        ]
        (RESULTS / "mutation_check.md").write_text(
            f"# Mutation check: {caught} of {len(rows)} deliberate bugs caught\n\n" + "\n".join(table) + "\n"
        )
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
