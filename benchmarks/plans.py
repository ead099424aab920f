"""What ``benchmarks/run.py`` measures, and how much: the models, and per mode (``full``, ``--quick``) the sizes
and repetitions of every section's jobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """One model's sizes for one section."""

    model: str
    train_size: int
    batch_size: int
    epochs: int
    learning_rate: float
    reps: int

    def worker_args(self) -> list[str]:
        return [
            f"--model={self.model}",
            f"--train-size={self.train_size}",
            f"--batch-size={self.batch_size}",
            f"--epochs={self.epochs}",
            f"--learning-rate={self.learning_rate}",
            f"--reps={self.reps}",
        ]


RNN_LR = 0.1
MINILM_LR = 5e-5

# (overhead jobs, ddp jobs with their number of launches per trainer, find_unused job and its launches)
PLANS: dict[str, dict[str, Any]] = {
    "full": {
        "overhead": [Job("rnn", 2048, 16, 1, RNN_LR, 8), Job("minilm", 192, 16, 1, MINILM_LR, 4)],
        "ddp": [(Job("rnn", 2048, 16, 2, RNN_LR, 3), 2), (Job("minilm", 256, 16, 1, MINILM_LR, 3), 2)],
        "find_unused": (Job("rnn", 2048, 16, 2, RNN_LR, 4), 2),
        "evaluation": (Job("minilm", 500, 32, 1, 0.0, 3), 2),
        "sharding": (Job("minilm", 256, 16, 1, MINILM_LR, 2), 2),
        "checkpointing": (Job("minilm", 1920, 8, 1, MINILM_LR, 2), 50),
        "resume": (Job("minilm", 800, 8, 1, MINILM_LR, 1), 5, 2),
        "end_to_end": (Job("minilm", 256, 16, 2, MINILM_LR, 2), 2, 500),
        "communication": [(Job("minilm", 512, 16, 1, MINILM_LR, 2), 3), (Job("rnn", 2048, 16, 2, RNN_LR, 3), 2)],
    },
    "quick": {
        "overhead": [Job("rnn", 512, 16, 1, RNN_LR, 2), Job("minilm", 64, 16, 1, MINILM_LR, 2)],
        "ddp": [(Job("rnn", 512, 16, 1, RNN_LR, 1), 1), (Job("minilm", 128, 16, 1, MINILM_LR, 1), 1)],
        "find_unused": (Job("rnn", 512, 16, 1, RNN_LR, 2), 1),
        "evaluation": (Job("minilm", 96, 16, 1, 0.0, 1), 1),
        "sharding": (Job("minilm", 64, 16, 1, MINILM_LR, 1), 1),
        "checkpointing": (Job("minilm", 192, 8, 1, MINILM_LR, 1), 4),
        "resume": (Job("minilm", 160, 8, 1, MINILM_LR, 1), 1, 1),
        "end_to_end": (Job("minilm", 64, 16, 1, MINILM_LR, 1), 1, 64),
        "communication": [(Job("minilm", 64, 16, 1, MINILM_LR, 1), 1), (Job("rnn", 512, 16, 1, RNN_LR, 1), 1)],
    },
}

MODEL_DESCRIPTIONS = {
    "rnn": "TextClassifier(DocumentRNNEmbeddings([OneHotEmbeddings.from_corpus(min_freq=1, 64 dims)], GRU 64)), "
    "trainer.train (SGD)",
    "minilm": "TextClassifier(TransformerDocumentEmbeddings(all-MiniLM-L6-v2, fine_tune=True)), "
    "trainer.fine_tune (AdamW, linear schedule)",
}
