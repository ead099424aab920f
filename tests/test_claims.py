"""The claim inventory (docs/claims.md) and the mutation check's list of deliberate bugs stay in step: every claim has
a bug, every bug breaks a listed claim, every test the inventory names exists, and every bug still applies to the
code as it is (its text occurs exactly once, and the planted code still parses)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

from .mutation_check import MUTATIONS, REPO, read_inventory


def test_every_claim_has_a_deliberate_bug_and_every_bug_breaks_a_listed_claim() -> None:
    claims = read_inventory()
    assert len(claims) >= 100, "the inventory is read (rows: | `id` | claim | tests |)"
    bugs = collections.Counter(mutation.claim for mutation in MUTATIONS)
    assert sorted(set(claims) - set(bugs)) == [], "claims without a deliberate bug"
    assert sorted(set(bugs) - set(claims)) == [], "bugs of claims the inventory does not list"
    names = collections.Counter(mutation.name for mutation in MUTATIONS)
    assert [name for name, count in names.items() if count > 1] == [], "bug names are unique"


def test_every_claim_names_tests_that_exist() -> None:
    functions: dict[Path, set[str]] = {}
    missing = []
    for claim in read_inventory().values():
        assert claim.tests, f"{claim.id}: no test guards it"
        for test in claim.tests:
            file, _, name = test.partition("::")
            path = REPO / file
            if path not in functions:
                tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
                functions[path] = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
            if not path.is_file() or (name and name.split("[")[0] not in functions[path]):
                missing.append(f"{claim.id}: {test}")
    assert missing == []


def test_every_deliberate_bug_applies_to_the_code_as_it_is() -> None:
    problems = []
    for mutation in MUTATIONS:
        planted: dict[str, str] = {}
        for relative, text, replacement in mutation.edits:
            source = planted.get(relative) or (REPO / relative).read_text()
            if source.count(text) != 1:
                problems.append(f"{mutation.name}: its text occurs {source.count(text)} times in {relative}")
                continue
            planted[relative] = source.replace(text, replacement)
        for relative, source in planted.items():
            try:
                ast.parse(source)
            except SyntaxError as error:
                problems.append(f"{mutation.name}: {relative} does not parse with the bug planted ({error})")
    assert problems == []
