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
    (
        "flair_fabric.distributed",
        "flair_fabric.state",
        "flair_fabric.launch.arguments",
        "flair_fabric.datasets",
        "flair_fabric.data",
        "flair_fabric.storage",
    ),
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


def _lazy_exports() -> dict[str, str]:
    """The package's public names and the module each is imported from on first use (``_PUBLIC`` in __init__)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["_PUBLIC"]:
            return ast.literal_eval(node.value)
    raise AssertionError("flair_fabric/__init__.py has no _PUBLIC")


DYNAMIC_IMPORTS = ("importlib.import_module", "import_module", "__import__")


def _imports(tree: ast.Module, name: str) -> set[str]:
    """The flair_fabric modules a module imports, anywhere in it (``TYPE_CHECKING`` blocks and functions too).
    ``from flair_fabric import Name`` imports the module the package's lazy export of ``Name`` comes from (a plain
    attribute of the package, ``__version__``, imports nothing more: the package is imported with any of its modules);
    ``importlib.import_module("flair_fabric...")`` and ``__import__("flair_fabric...")`` import their module. Only the
    package's own ``__getattr__`` may import a module whose name is not written out."""
    found, exports = set(), _lazy_exports()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "flair_fabric":
            found.update(exports.get(alias.name, f"flair_fabric.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flair_fabric"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative imports: not used in the package
            raise AssertionError(f"{name}: a relative import")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("flair_fabric."))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in DYNAMIC_IMPORTS and node.args:
            target = node.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                if target.value.startswith("flair_fabric"):
                    found.add(target.value)
            else:
                assert name == "flair_fabric", f"{name}:{node.lineno}: an import whose module is not written out"
    return found


COMMAND_LINE = ("flair_fabric.__main__", "flair_fabric.cli", "flair_fabric.shell")
"""The top: the command line composes the entry points as a user's script does."""


def _is_command_line(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in COMMAND_LINE)


def _layer(module: str) -> int:
    if _is_command_line(module):
        return len(LAYERS) + 1
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
            if name == "flair_fabric":  # the package's lazy exports: imported on first use, by name
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
        if imported in FACADES - {"flair_fabric"} and name != "flair_fabric" and not _is_command_line(name)
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


def _strategy_classes(tree: ast.Module) -> set[str]:
    """The names a module binds to a strategy class (``...Strategy``, a tuple of them ``...STRATEGIES``), aliases
    included (``from ... import FlairFSDPStrategy as Sharded``)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name.split(".")[-1].endswith(("Strategy", "STRATEGIES")):
                    bound.add(alias.asname or alias.name.split(".")[-1])
    return bound


def _is_strategy_class(node: ast.expr, aliases: set[str]) -> bool:
    return any(name.endswith(("Strategy", "STRATEGIES")) or name in aliases for name in _names(node))


def _mentions_a_strategy(node: ast.expr) -> bool:
    """Whether an expression reads a strategy: a name or attribute called ``...strategy...``."""
    return any(
        "strategy" in (sub.id if isinstance(sub, ast.Name) else sub.attr).lower()
        for sub in ast.walk(node)
        if isinstance(sub, (ast.Name, ast.Attribute))
    )


def _asks_a_strategy(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Call) and _names(node.func)[-1:] in (["isinstance"], ["issubclass"]):
        return len(node.args) == 2 and (_is_strategy_class(node.args[1], aliases) or _mentions_a_strategy(node.args[0]))
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "type" and len(node.args) == 1:
        return _mentions_a_strategy(node.args[0])
    if isinstance(node, ast.Attribute) and node.attr == "__class__":
        return _mentions_a_strategy(node.value)
    if isinstance(node, ast.Compare):
        return any(_is_strategy_class(part, aliases) for part in [node.left, *node.comparators])
    return False


def test_only_the_strategies_package_asks_which_strategy_it_has() -> None:
    """Outside strategies/ nothing asks a strategy's type: no isinstance or issubclass against a strategy class
    (``...Strategy``, a tuple ``...STRATEGIES``, an alias of one) or of a strategy object, no ``type(...)`` or
    ``.__class__`` of a strategy (its name for a log line comes from ``strategies.strategy_name``), no comparison
    with a strategy class."""
    asked = []
    for path in PACKAGE.rglob("*.py"):
        if "strategies" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text())
        aliases = _strategy_classes(tree)
        asked.extend(
            f"{path.relative_to(PACKAGE)}:{node.lineno}" for node in ast.walk(tree) if _asks_a_strategy(node, aliases)
        )
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
