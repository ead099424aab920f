"""The package's shape: imports run one way, through layers, without cycles (``TYPE_CHECKING`` imports included);
only ``strategies/`` asks which strategy a run has; there is one launch path; facades stay small; the typed
arguments mirror flair's own signature and are declared once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from flair.trainers import ModelTrainer

from flair_fabric.training.arguments import FlairArguments

PACKAGE = Path(__file__).resolve().parents[1] / "flair_fabric"

FACADES = {
    "flair_fabric",
    "flair_fabric.__main__",
    "flair_fabric.cli",
    "flair_fabric.trainer",
    "flair_fabric.language_model.trainer",
    "flair_fabric.prediction.api",
    "flair_fabric.evaluation.api",
}
"""The entry points: signatures and argument binding, each handing one job to the runner."""

LAYERS = [
    ("flair_fabric.distributed", "flair_fabric.state", "flair_fabric.launch.arguments", "flair_fabric.datasets"),
    ("flair_fabric.strategies",),
    ("flair_fabric.launch",),
    ("flair_fabric.evaluation", "flair_fabric.plugins"),
    ("flair_fabric.training", "flair_fabric.language_model", "flair_fabric.prediction"),
]
"""Lowest first: a module imports only from its own layer or lower ones; the facades sit on top."""


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = ast.parse(path.read_text())
    return modules


def _imports(tree: ast.Module, name: str) -> set[str]:
    """The flair_fabric modules a module imports, anywhere in it (``TYPE_CHECKING`` blocks and functions too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flair_fabric"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative imports: not used in the package
            raise AssertionError(f"{name}: a relative import")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("flair_fabric"))
    return found


def _layer(module: str) -> int:
    if module in FACADES:
        return len(LAYERS)
    for number, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return number
    raise AssertionError(f"{module} belongs to no layer: add its folder to LAYERS")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {i for i in _imports(tree, name) if i in modules} for name, tree in modules.items()}


def test_the_import_graph_has_no_cycle_type_checking_imports_included() -> None:
    graph = _graph()
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph.get(name, ())):
            if name == "flair_fabric" or imported == "flair_fabric":  # the package's lazy exports
                continue
            assert state.get(imported) != "open", " -> ".join([*path, imported])
            if imported not in state:
                visit(imported, [*path, imported])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = [
        f"{name} (layer {_layer(name)}) imports {imported} (layer {_layer(imported)})"
        for name, imported_modules in _graph().items()
        for imported in imported_modules
        if name != "flair_fabric" and imported != "flair_fabric" and _layer(imported) > _layer(name)
    ]
    assert wrong == []


def test_nothing_imports_a_facade() -> None:
    importers = [
        f"{name} imports {imported}"
        for name, imported_modules in _graph().items()
        for imported in imported_modules
        if imported in FACADES - {"flair_fabric"} and name not in ("flair_fabric", "flair_fabric.__main__")
    ]
    assert importers == []


def _names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _names(element)]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Name):
        return [node.id]
    return []


def test_only_the_strategies_package_asks_which_strategy_it_has() -> None:
    """Every isinstance (or issubclass) whose class is a strategy (``...Strategy``, a tuple of them, a name in capitals
    ending in STRATEGIES) sits in strategies/."""
    asked = []
    for path in PACKAGE.rglob("*.py"):
        if "strategies" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _names(node.func)[-1:] in (["isinstance"], ["issubclass"]):
                classes = _names(node.args[1]) if len(node.args) == 2 else []
                if any(name.endswith(("Strategy", "STRATEGIES")) for name in classes):
                    asked.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert asked == []


def test_one_launch_call_site_and_every_entry_point_uses_the_runner() -> None:
    """``fabric.launch`` is called in the runner only, once per path (in the caller, in workers); the four jobs go
    through ``run_job``."""
    launches = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch":
                launches.append(name)
    assert sorted(set(launches)) == ["flair_fabric.launch.runner"]
    assert len(launches) == 2, "one call in the caller's rank, one for spawned or forked workers"
    for facade in ("trainer", "language_model/trainer", "prediction/api", "evaluation/api"):
        assert "run_job(" in (PACKAGE / f"{facade}.py").read_text(), facade


def test_facades_are_small_and_no_module_or_class_is_large() -> None:
    """A facade keeps signatures and argument binding (flair's override points for FabricTrainer); everything else is
    in the layers below. No module is over 400 lines, no class over 300."""
    sizes = {name: len((PACKAGE / f"{name}.py").read_text().splitlines()) for name in ("trainer", "cli")}
    assert sizes["trainer"] <= 220, sizes
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        assert len(lines) <= 400, f"{path.relative_to(PACKAGE)}: {len(lines)} lines"
        for node in ast.parse("\n".join(lines)).body:
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 300, f"{path.name}: class {node.name}"


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
