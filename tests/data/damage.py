"""Damage done to a cache entry's file as an outside trial did it (a truncated file, 16 bytes overwritten at some
offsets, a missing file, a changed record), and the scripts that open the damaged entry in a fresh interpreter, so
that a crash of the interpreter (a segmentation fault) shows as an exit code the test asserts on."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any


def damage(path: Path, case: dict[str, Any]) -> None:
    """Damage ``path`` as ``case["kind"]`` says: ``truncate`` (to half), ``missing``, ``overwrite`` (16 random bytes at
    each fraction of the size in ``case["at"]``, seeded by ``case["seed"]``) or ``record`` (a ``meta.json`` whose
    row count says one more)."""
    kind = case["kind"]
    if kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "missing":
        path.unlink()
    elif kind == "overwrite":
        size, noise = path.stat().st_size, random.Random(case["seed"])
        with open(path, "r+b") as file:
            for fraction in case["at"]:
                offset = min(int(size * fraction), size - 16)
                file.seek(offset)
                original = file.read(16)
                replacement = bytes(noise.randrange(256) for _ in range(16))
                while replacement == original:
                    replacement = bytes(noise.randrange(256) for _ in range(16))
                file.seek(offset)
                file.write(replacement)
    elif kind == "record":
        meta = json.loads(path.read_text())
        meta["splits"]["train"]["rows"] += 1
        path.write_text(json.dumps(meta))
    else:
        raise ValueError(f"unknown damage {kind!r}")


def cases(file: str) -> list[dict[str, Any]]:
    """The trial's damage to ``file``: truncated; 16 bytes at each of 19 offsets, one at a time, then all at once;
    the last 16 bytes; the file missing; and a ``meta.json`` that says another row count."""
    single = [
        {"name": f"overwrite-{step}-of-19", "file": file, "kind": "overwrite", "at": [step / 19], "seed": step}
        for step in range(19)
    ]
    return [
        {"name": "truncated", "file": file, "kind": "truncate"},
        *single,
        {
            "name": "overwrite-19-offsets",
            "file": file,
            "kind": "overwrite",
            "at": [i / 19 for i in range(19)],
            "seed": 0,
        },
        {"name": "overwrite-the-end", "file": file, "kind": "overwrite", "at": [1.0], "seed": 99},
        {"name": "missing", "file": file, "kind": "missing"},
        {"name": "record", "file": "meta.json", "kind": "record"},
    ]


# argv: the jobs (JSON: each a source folder or "memory:<train size>", a cache folder and the cases); prints one JSON
# line a case
REOPEN = r"""
import hashlib, json, sys
from pathlib import Path
from flair_fabric.data import MappedCorpus, map_corpus
from flair_fabric.datasets import trec_corpus
from tests.data.damage import damage
from tests.data.reference import describe_split

def open_corpus(source, cache):
    if source.startswith("memory:"):
        return map_corpus(trec_corpus(int(source.split(":")[1]), 0, 0), cache_folder=cache)
    return MappedCorpus.from_column_files(source, {0: "text", 1: "ner"}, column_delimiter="\t",
                                          sample_missing_splits=False, cache_folder=cache)

for job in json.loads(sys.argv[1]):
    folder = open_corpus(job["source"], job["cache"]).cache_folder
    for case in job["cases"]:
        damage(folder / case["file"], case)
        corpus = open_corpus(job["source"], job["cache"])
        described = hashlib.sha256(repr(describe_split(corpus.train)).encode()).hexdigest()
        print(json.dumps({"case": case["name"], "built": corpus.built, "data": described}), flush=True)
"""

# argv: a file of pickled splits (one per line, hex), the original file's copy, the cases (JSON)
WITHOUT_SOURCES = r"""
import json, pickle, shutil, sys
from pathlib import Path
from flair_fabric.data import DamagedCacheError
from tests.data.damage import damage

splits = [pickle.loads(bytes.fromhex(line)) for line in Path(sys.argv[1]).read_text().split()]
originals, cases = json.loads(sys.argv[2]), json.loads(sys.argv[3])
for case in cases:
    for split in splits:
        path = Path(split.path)
        target = path.parent / case["file"]
        shutil.copyfile(originals[str(target)], target)
        damage(target, case)
        fresh = pickle.loads(pickle.dumps(split))
        try:
            fresh[0]
            error = None
        except DamagedCacheError as refused:
            error = str(refused)
        print(json.dumps({"case": case["name"], "file": str(target), "error": error}), flush=True)
        shutil.copyfile(originals[str(target)], target)
"""
