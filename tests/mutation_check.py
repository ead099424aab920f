"""The mutation check (``make mutation-check``): plant each deliberate bug of ``tests/mutations.toml`` in a copy of the
repository, one at a time, and run the test folders that hold the tests of the claim it breaks; report caught or
survived.

Every claim a user may rely on is a row of the claim inventory, ``docs/claims.md`` (its id, the sentence, the tests
that guard it). Every row has at least one deliberate bug, written from the claim's sentence, and a bug is run
against the *folders* of the claim's tests (the whole folder, not one chosen test: an outside audit plants bugs
nobody listed and runs folders). A bug counts as caught only when a test fails on an assertion or an expected error
(``pytest.raises`` that did not raise): a crash in the mutated code or a collection error does not count, and a
timeout counts only where the claim is about hanging (``hangs=True``). The claim's own tests run first (or the test
that caught the bug last time), then the rest of the folders: the verdict is the folders', only sooner. The first test
that catches a bug is printed.
``tests/test_claims.py`` keeps the inventory and this list in step.

    python tests/mutation_check.py                  # every bug; results in benchmarks/results/mutation_check.*
    python tests/mutation_check.py predict resume   # the bugs whose name or claim id contains a word
    python tests/mutation_check.py --from 120       # the bugs from the 120th on (a long check in parts)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
INVENTORY = REPO / "docs" / "claims.md"
TIMEOUT_PER_TEST = 300
TIMEOUT_PER_BUG = 2400


@dataclass(frozen=True)
class Mutation:
    """A deliberate bug: ``edits`` (file, text, replacement; each text occurs exactly once) that break the claim
    ``claim`` (an id of docs/claims.md). ``hangs``: the claim is that something does not hang, so a test that times
    out catches it."""

    name: str
    claim: str
    edits: list[tuple[str, str, str]]
    hangs: bool = False


@dataclass(frozen=True)
class Claim:
    """A row of the claim inventory."""

    id: str
    text: str
    tests: list[str]

    @property
    def folders(self) -> list[str]:
        """What a bug in this claim is run against: the folder of each test (a test file at the top of tests/
        stands for itself)."""
        places = set()
        for test in self.tests:
            path = Path(test.split("::")[0])
            places.add(str(path) if path.parent == Path("tests") else str(path.parent))
        return sorted(places)


_ROW = re.compile(r"^\|\s*`(?P<id>[a-z0-9.-]+)`\s*\|(?P<text>.*)\|(?P<tests>[^|]*)\|\s*$")


def read_inventory(path: Path = INVENTORY) -> dict[str, Claim]:
    """The claims of docs/claims.md by id: rows ``| `id` | claim | `tests/...py::test`, ... |``."""
    claims: dict[str, Claim] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            tests = re.findall(r"`(tests/[^`]+)`", match["tests"])
            claims[match["id"]] = Claim(match["id"], match["text"].strip(), tests)
    return claims


MUTATIONS_FILE = Path(__file__).with_name("mutations.toml")


def read_mutations(path: Path = MUTATIONS_FILE) -> list[Mutation]:
    """The deliberate bugs of ``tests/mutations.toml``."""
    listed = tomllib.loads(path.read_text(encoding="utf-8"))["mutation"]
    return [
        Mutation(
            each["name"],
            each["claim"],
            [(edit["file"], edit["text"], edit["replacement"]) for edit in each["edit"]],
            each.get("hangs", False),
        )
        for each in listed
    ]


MUTATIONS = read_mutations()


def _copy_repository(target: Path) -> None:
    ignored = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "runs", ".whl"
    )
    shutil.copytree(REPO, target, ignore=ignored)


def apply(root: Path, mutation: Mutation) -> None:
    """Plant ``mutation`` in the copy of the repository at ``root``."""
    for relative, text, replacement in mutation.edits:
        path = root / relative
        source = path.read_text()
        if source.count(text) != 1:
            raise SystemExit(f"mutation {mutation.name!r}: {text!r} occurs {source.count(text)} times in {relative}")
        path.write_text(source.replace(text, replacement))


def _previous_results() -> dict[str, dict]:
    path = RESULTS / "mutation_check.json"
    if not path.is_file():
        return {}
    results = json.loads(path.read_text())
    rows = results["rows"] if isinstance(results, dict) else results  # a check in parts also lists the bugs not run
    return {row["mutation"]: row for row in rows}


def check(mutation: Mutation, claim: Claim, hint: str | None) -> dict:
    """Run the claim's test folders against the mutated copy; the row of the results."""
    with tempfile.TemporaryDirectory(prefix="flair-fabric-mutation-") as folder:
        root = Path(folder) / "repo"
        _copy_repository(root)
        apply(root, mutation)
        verdict = Path(folder) / "verdict.jsonl"
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "FLAIR_FABRIC_VERDICT": str(verdict),
            "FLAIR_FABRIC_TESTS_FIRST": hint or "",
            "FLAIR_FABRIC_HANG_COUNTS": "1" if mutation.hangs else "0",
        }
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={TIMEOUT_PER_TEST}"]
        started = time.monotonic()
        timed_out = False
        try:
            subprocess.run(
                [*command, *claim.folders], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_PER_BUG
            )
        except subprocess.TimeoutExpired:
            timed_out = True
        seconds = time.monotonic() - started
        failures = [json.loads(line) for line in verdict.read_text().splitlines()] if verdict.is_file() else []
    counted = [failure for failure in failures if failure["kind"] is not None]
    caught_by = counted[0] if counted else None
    if caught_by is None and timed_out and mutation.hangs:
        caught_by = {"test": f"(the folders did not end within {TIMEOUT_PER_BUG} s)", "kind": "timeout", "message": ""}
    not_counted = [f"{failure['test']}: {failure['message']}" for failure in failures if failure["kind"] is None]
    return {
        "mutation": mutation.name,
        "claim": claim.id,
        "tests": claim.folders,
        "caught": caught_by is not None,
        "caught_by": caught_by["test"] if caught_by else None,
        "kind": caught_by["kind"] if caught_by else None,
        "message": caught_by["message"] if caught_by else None,
        "failures_not_counted": not_counted[:5],
        "seconds": round(seconds),
    }


def run(selected: list[str]) -> int:
    """Run the mutations whose name or claim id contains one of ``selected`` (all if empty); 0 if every one was
    caught."""
    claims = read_inventory()
    previous = _previous_results()
    rows = []
    started = time.monotonic()
    for mutation in MUTATIONS:
        if selected and not any(word in mutation.name or word in mutation.claim for word in selected):
            continue
        # first the test that caught it last time, else the claim's own tests; then the rest of the folders
        hint = (previous.get(mutation.name) or {}).get("caught_by") or ",".join(claims[mutation.claim].tests)
        row = check(mutation, claims[mutation.claim], hint)
        rows.append(row)
        status = "caught  " if row["caught"] else "SURVIVED"
        by = f"by {row['caught_by']} ({row['kind']})" if row["caught"] else f"in {' '.join(row['tests'])}"
        print(f"{status} {row['seconds']:5d} s  {mutation.name} [{mutation.claim}] {by}", flush=True)
        for failure in row["failures_not_counted"]:
            print(f"           not counted: {failure}", flush=True)
    caught = sum(row["caught"] for row in rows)
    total = round(time.monotonic() - started)
    print(f"\n{caught} of {len(rows)} deliberate bugs caught, {len(claims)} claims, {total} s")
    if not selected:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "mutation_check.json").write_text(json.dumps(rows, indent=2) + "\n")
        table = ["| deliberate bug | claim | caught by | seconds |", "|---|---|---|---|"]
        table += [
            f"| {r['mutation']} | `{r['claim']}` | {r['caught_by'] or '**survived**'} | {r['seconds']} |" for r in rows
        ]
        (RESULTS / "mutation_check.md").write_text(
            f"# Mutation check: {caught} of {len(rows)} deliberate bugs caught\n\n"
            f"{len(claims)} claims (docs/claims.md); each bug run against the test folders of its claim; {total} s"
            " in all.\n\n" + "\n".join(table) + "\n"
        )
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--from"]:  # a long check in parts: the bugs from the n-th on (0-based)
        MUTATIONS[:] = MUTATIONS[int(arguments[1]) :]
        arguments = arguments[2:] or [""]  # a selection: the results of a part are printed, not written
    raise SystemExit(run(arguments))
