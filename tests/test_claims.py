"""The claim inventory (docs/claims.md) and the mutation check's list of deliberate bugs stay in step: every claim has
a bug, every bug breaks a listed claim, every test the inventory names exists, and every bug still applies to the
code as it is (its text occurs exactly once, and the planted code still parses)."""

from __future__ import annotations

import ast
import collections
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import failure_kind
from .mutation_check import MUTATIONS, REPO, read_inventory
from .support import RunCrashed, RunHung


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


def _names(node: ast.expr | None) -> set[str]:
    """The exception names an ``except`` clause catches (``None``: a bare except)."""
    if node is None:
        return {"BaseException"}
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(element) for element in node.elts))
    return {ast.unparse(node)}


def _fails(statement: ast.stmt) -> bool:
    """Whether a statement fails the test whatever the error was: an assert, ``raise AssertionError``, pytest.fail."""
    if isinstance(statement, ast.Assert):
        return True
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        return ast.unparse(statement.exc).startswith("AssertionError")
    return isinstance(statement, ast.Expr) and ast.unparse(statement.value).startswith("pytest.fail(")


def test_no_test_turns_any_error_into_a_failure() -> None:
    """A catch is an assertion or an error the test expected by type (docs/testing.md): no ``except`` clause that
    catches every error (``Exception``, ``BaseException``, bare) fails the test unconditionally, and none catches an
    assertion or a pytest.fail to hand it on as something else. An expected error is expected by its type: no
    ``pytest.raises(Exception)``."""
    broad, caught_failures = {"Exception", "BaseException"}, {"AssertionError", "pytest.fail.Exception"}
    problems = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "pytest.raises"
                and _names(node.args[0]) & broad
            ):
                problems.append(f"{where}: pytest.raises(Exception) takes any error: expect the error's type")
            if not isinstance(node, ast.ExceptHandler):
                continue
            if _names(node.type) & broad and any(_fails(statement) for statement in node.body):
                problems.append(f"{where}: every error fails the test (catch the error the test means)")
            if _names(node.type) & caught_failures:
                problems.append(f"{where}: an assertion or pytest.fail is caught")
    assert problems == []


def _raised(function: Callable[[], object]) -> pytest.ExceptionInfo:
    try:
        function()
    except BaseException:
        return pytest.ExceptionInfo.from_current()
    raise RuntimeError("nothing was raised")


def _code_under_test_asserts() -> None:
    """An ``assert`` of the code under test (compiled as a module of the package)."""
    namespace: dict[str, Callable[[], None]] = {}
    exec(
        compile("def step():\n    assert False, 'optimizer'\n", str(REPO / "flair_fabric" / "x.py"), "exec"), namespace
    )
    namespace["step"]()


def _did_not_raise() -> None:
    with pytest.raises(ValueError):
        pass


def _wrong_message() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        raise ValueError("devices")


def _test_asserts() -> None:
    assert pytest.approx(0.4) == 0.1 + 0.2


@pytest.mark.parametrize(
    ("function", "when", "kind"),
    [
        (_test_asserts, "call", "assertion"),
        (_wrong_message, "call", "assertion"),
        (_did_not_raise, "call", "expected error"),
        (lambda: pytest.fail("a rank was left waiting in a collective"), "call", "expected error"),
        (lambda: pytest.fail("Timeout >300.0s"), "call", "timeout"),
        (lambda: _raise(RunHung("the job did not end within 120 s")), "call", "timeout"),
        (_code_under_test_asserts, "call", "crashed"),
        (lambda: _raise(RunCrashed("ddp_runs.py failed with exit code 1")), "call", "crashed"),
        (lambda: _raise(RuntimeError("Received data size doesn't match expected size")), "call", "crashed"),
        (_test_asserts, "setup", "crashed"),
    ],
)
def test_the_mutation_check_tells_a_catch_from_a_crash(function: Callable[[], None], when: str, kind: str) -> None:
    """Only an assertion of the tests' own code or an expected error catches a bug; an assertion of the code under
    test, a process that failed, any other error and a fixture's failure are crashes; a hang is a timeout."""
    assert failure_kind(_raised(function), when) == kind


def _raise(error: BaseException) -> None:
    raise error
