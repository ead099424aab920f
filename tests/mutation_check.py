"""The mutation check (``make mutation-check``): plant each deliberate bug of ``tests/mutations/*.toml`` in a copy of
the repository, one at a time, and run the test folders that hold the tests of the claim it breaks; report caught,
crashed or survived.

Every claim a user may rely on is a row of the claim inventory, ``docs/claims.md`` (its id, the sentence, the tests
that guard it). Every row has at least one deliberate bug, written from the claim's sentence, and a bug is run
against the *folders* of the claim's tests (the whole folder, not one chosen test: an outside audit plants bugs
nobody listed and runs folders). A bug is **caught** only when a test fails on an assertion of the tests' own code or
on an error it expected (``pytest.raises`` that did not raise, a ``pytest.fail`` of a test); a timeout counts only
where the claim is about hanging (``hangs = true``). A bug that only made tests **crash** (an error of the mutated
code, a process that exited with an error, a fixture error) is not caught: it shows in the results' "crashed" column.
``tests/conftest.py`` tells the kinds apart. The claim's own tests run first (or the test that caught the bug last
time), then the rest of the folders: the verdict is the folders', only sooner. ``tests/test_claims.py`` keeps the
inventory and this list in step.

Every run writes its verdicts into ``benchmarks/results/mutation_check.{json,md}`` (each bug's latest verdict, with
the commit it ran on), so a check may run in parts, also at the same time:

    python tests/mutation_check.py                   # every bug
    python tests/mutation_check.py predict resume    # the bugs whose name or claim id contains a word
    python tests/mutation_check.py --from 120        # the bugs from the 120th on
    python tests/mutation_check.py --not-caught      # the bugs whose latest verdict is not "caught", or not run
    python tests/mutation_check.py --no-record word  # print the verdicts only
"""

from __future__ import annotations

import argparse
import collections
import fcntl
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
MUTATIONS_FOLDER = Path(__file__).with_name("mutations")
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


def read_mutations(folder: Path = MUTATIONS_FOLDER) -> list[Mutation]:
    """The deliberate bugs of ``tests/mutations/*.toml`` (one file per docs page), in file order."""
    listed = [each for path in sorted(folder.glob("*.toml")) for each in tomllib.loads(path.read_text())["mutation"]]
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
    counted = [failure for failure in failures if failure["counts"]]
    caught_by = counted[0] if counted else None
    if caught_by is None and timed_out and mutation.hangs:
        caught_by = {"test": f"(the folders did not end within {TIMEOUT_PER_BUG} s)", "kind": "timeout", "message": ""}
    crashes = [failure for failure in failures if not failure["counts"]]
    return {
        "mutation": mutation.name,
        "claim": claim.id,
        "tests": claim.folders,
        "verdict": "caught" if caught_by else "crashed" if crashes or timed_out else "survived",
        "caught_by": caught_by["test"] if caught_by else None,
        "kind": caught_by["kind"] if caught_by else None,
        "message": caught_by["message"] if caught_by else None,
        "crashed": [f"{crash['test']} ({crash['kind']}): {crash['message']}" for crash in crashes[:5]],
        "seconds": round(seconds),
    }


def _code_version() -> str:
    """The commit the check runs on, marked when the package or the tests differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "flair_fabric", "tests"], cwd=REPO, capture_output=True, text=True
    )
    return commit.stdout.strip() + (" (with uncommitted changes)" if changed.stdout.strip() else "")


def previous_results() -> dict[str, dict]:
    """Each bug's latest verdict, by name."""
    path = RESULTS / "mutation_check.json"
    if not path.is_file():
        return {}
    return {row["mutation"]: row for row in json.loads(path.read_text())["rows"]}


def write_results(rows: dict[str, dict], claims: int) -> str:
    """Write each listed bug's latest verdict to benchmarks/results/mutation_check.{json,md}; the summary line."""
    listed = [rows[m.name] for m in MUTATIONS if m.name in rows]
    not_run = [m.name for m in MUTATIONS if m.name not in rows]
    verdicts = collections.Counter(row["verdict"] for row in listed)
    others = "".join(f", {count} {verdict}" for verdict, count in verdicts.items() if verdict != "caught")
    summary = (
        f"{verdicts['caught']} of {len(MUTATIONS)} deliberate bugs caught{others}, {len(not_run)} not run"
        f" ({claims} claims)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation_check.json").write_text(json.dumps({"rows": listed, "not_run": not_run}, indent=2) + "\n")
    table = [
        "| deliberate bug | claim | caught by | kind | crashed | seconds | ran on |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in listed:
        crashed = "<br>".join(crash.replace("|", "/") for crash in row["crashed"]) if row["verdict"] != "caught" else ""
        caught_by = row["caught_by"] or f"**{row['verdict']}**"
        table.append(
            f"| {row['mutation']} | `{row['claim']}` | {caught_by} | {row['kind'] or ''} | {crashed} "
            f"| {row['seconds']} | {row['ran_on']} |"
        )
    (RESULTS / "mutation_check.md").write_text(
        f"# Mutation check: {summary}\n\nEach bug's latest verdict, run against the test folders of its claim, with the"
        " code it ran on. Caught: a test failed on an assertion of its own or an expected error (a timeout only for"
        " the claims about hanging). Crashed: tests failed only by crashing (the first are listed), which does not"
        f" count.\n\n{chr(10).join(table)}\n" + (f"\nNot run: {', '.join(not_run)}\n" if not_run else "")
    )
    return summary


def run(mutations: list[Mutation], record: bool = True) -> int:
    """Run ``mutations``, record their verdicts (unless ``record`` is false); 0 if every one was caught."""
    claims = read_inventory()
    results = previous_results()
    version = _code_version()
    started = time.monotonic()
    ran = []
    for mutation in mutations:
        # first the test that caught it last time, then the claim's own tests; then the rest of the folders
        last = (results.get(mutation.name) or {}).get("caught_by")
        hint = ",".join([*([last] if last else []), *claims[mutation.claim].tests])
        row = {**check(mutation, claims[mutation.claim], hint), "ran_on": version}
        results[mutation.name] = row
        ran.append(row)
        by = f"by {row['caught_by']} ({row['kind']})" if row["caught_by"] else f"in {' '.join(row['tests'])}"
        print(f"{row['verdict']:8} {row['seconds']:5d} s  {mutation.name} [{mutation.claim}] {by}", flush=True)
        for crash in row["crashed"] if row["verdict"] != "caught" else []:
            print(f"           crashed: {crash}", flush=True)
        if record:  # after every bug: a check stopped half-way keeps what it found
            record_verdicts(ran, len(claims))
    caught = sum(row["verdict"] == "caught" for row in ran)
    print(f"\nthis run: {caught} of {len(ran)} caught in {round(time.monotonic() - started)} s")
    if record:
        print(record_verdicts(ran, len(claims)))
    return 0 if caught == len(ran) else 1


def record_verdicts(rows: list[dict], claims: int) -> str:
    """Merge ``rows`` into the results files as they are on disk now, under a lock: checks in parts may run at the
    same time. The summary line."""
    with open(RESULTS / ".mutation_check.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return write_results({**previous_results(), **{row["mutation"]: row for row in rows}}, claims)


def main(arguments: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("words", nargs="*", help="run the bugs whose name or claim id contains one of these")
    parser.add_argument("--from", dest="start", type=int, default=0, help="run the bugs from this one on (0-based)")
    parser.add_argument("--not-caught", action="store_true", help="run the bugs whose latest verdict is not caught")
    parser.add_argument("--no-record", action="store_true", help="print the verdicts, leave the results files alone")
    parser.add_argument("--part", default="0/1", help="I/N: every N-th bug from the I-th, for N parts at once")
    options = parser.parse_args(arguments)
    part, parts = (int(number) for number in options.part.split("/"))
    previous = previous_results()
    chosen = [
        mutation
        for index, mutation in enumerate(MUTATIONS[options.start :])
        if index % parts == part
        and (not options.words or any(word in mutation.name or word in mutation.claim for word in options.words))
        and (not options.not_caught or (previous.get(mutation.name) or {}).get("verdict") != "caught")
    ]
    return run(chosen, record=not options.no_record)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
