"""The package's shape: imports run one way, the facade stays small, strategies are looked at in one place, the
typed arguments mirror flair's own signature."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from flair.trainers import ModelTrainer

from flair_fabric.training.arguments import FlairArguments

PACKAGE = Path(__file__).resolve().parents[1] / "flair_fabric"


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = ast.parse(path.read_text())
    return modules


def _imports(tree: ast.Module) -> set[str]:
    """flair_fabric modules imported at run time (not under ``if TYPE_CHECKING``)."""
    type_checking = {
        id(node)
        for block in tree.body
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
        for node in ast.walk(block)
    }
    return {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("flair_fabric")
        and id(node) not in type_checking
    }


def test_the_import_graph_has_no_cycle() -> None:
    graph = {name: _imports(tree) for name, tree in _modules().items()}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in graph.get(name, ()):
            assert state.get(imported) != "open", " -> ".join([*path, imported])
            if imported not in state:
                visit(imported, [*path, imported])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_facade_is_small_and_no_class_is_large() -> None:
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= 260
    for name, tree in _modules().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 300, f"{name}.{node.name}"


def test_only_the_strategies_package_asks_which_strategy_it_has() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "strategies" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "isinstance(" in line:
                assert "FSDPStrategy" not in line and "DeepSpeed" not in line, f"{path}:{number}: {line.strip()}"


def test_the_typed_arguments_are_flairs_own() -> None:
    """An independent reference: flair's signature of ``train_custom`` (names) and its defaults bind into them."""
    flairs = [name for name in inspect.signature(ModelTrainer.train_custom).parameters if name != "self"]
    assert [field.name for field in dataclasses.fields(FlairArguments)] == flairs
    bound = FlairArguments.bind(ModelTrainer.__new__(ModelTrainer), "out")
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(ModelTrainer.train_custom).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    assert {name: getattr(bound, name) for name in defaults} == defaults
    assert bound.optimizer_arguments == {"lr": defaults["learning_rate"]}
