"""A user's script WITHOUT `if __name__ == "__main__":` that trains with spawned workers at module level:
`python unguarded_spawn.py OUT TRAIN_SIZE` (or `python -m tests.scripts.unguarded_spawn OUT TRAIN_SIZE`).

Each spawned worker imports this file again and reaches the `train` call; the run must end with the guard message,
not hang. The corpus (TRAIN_SIZE TREC questions) makes the job the workers receive larger than a pipe buffer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flair_fabric import FabricTrainer
from tests.support import small_trec, tiny_text_classifier

corpus = small_trec(train_size=int(sys.argv[2]))
trainer = FabricTrainer(tiny_text_classifier(corpus), corpus)
settings = {"accelerator": "cpu", "devices": 2, "strategy": "ddp_spawn", "create_file_logs": False}
trainer.train(sys.argv[1], max_epochs=1, mini_batch_size=8, **settings)
print("TRAINED")
