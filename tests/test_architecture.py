"""The package's layers, read from its own imports (docs/concepts/architecture.md draws them).

Every module of ``loomflow`` is parsed with ``ast``. An import anywhere in a module counts,
inside functions too (a lazy import is still a dependency, and the usual hiding place of a
circle); only imports under ``if TYPE_CHECKING:`` are left out, since they never run.
Importing ``a.b.c`` also runs the ``__init__`` of ``a.b`` (unless the importer lives inside
it), so that is an arrow too. The top-level package's ``__init__`` is left out of those
implicit arrows: every module sits under it.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import loomflow

PACKAGE = Path(loomflow.__file__).parent

# The floors of docs/concepts/architecture.md, bottom first: a module imports its own floor
# or lower ones. ("loomflow" is the top-level __init__ alone.)
FLOORS = [
    [
        "loomflow._cleanup",
        "loomflow._files",
        "loomflow._ids",
        "loomflow._json",
        "loomflow._locks",
        "loomflow._memo",
        "loomflow._pii",
        "loomflow._printable",
        "loomflow._progress",
        "loomflow._sealed",
        "loomflow._settings_doc",
        "loomflow._timefmt",
        "loomflow.config",
        "loomflow.context",
        "loomflow.errors",
    ],
    ["loomflow.storage", "loomflow.redaction"],
    ["loomflow.runtime"],
    ["loomflow.tools", "loomflow.messages"],
    ["loomflow.checkpoints", "loomflow.memory", "loomflow.models"],
    ["loomflow.hooks"],
    ["loomflow.governance"],
    ["loomflow.audit", "loomflow.telemetry"],
    ["loomflow.stores"],
    ["loomflow.agent"],
    ["loomflow.recovery"],
    ["loomflow.testing"],
    ["loomflow.console"],
    ["loomflow.cli", "loomflow", "loomflow.__main__"],
]

LOW_LAYERS = ("loomflow.runtime", "loomflow.storage", "loomflow.hooks")
HIGH_LAYERS = (
    "loomflow.agent",
    "loomflow.governance",
    "loomflow.audit",
    "loomflow.telemetry",
    "loomflow.cli",
)

# Who may import the agent besides the agent package itself, and why.
AGENT_IMPORTERS = {
    "loomflow": "the top-level package hands out Agent and its events (loaded on first use)",
    "loomflow.cli": "the command line runs agents (demo, worker)",
    "loomflow.recovery": "recovery resumes orphaned runs through the registered agents",
    "loomflow.testing.checkpoint_conformance": (
        "the checkpoint suite checks that a store restores a real agent's run; test helpers, "
        "imported only by tests"
    ),
    "loomflow.testing.memory_conformance": (
        "the memory suite checks that a store records a real agent's episodes; test helpers, "
        "imported only by tests"
    ),
    "loomflow.audit.sealing": (
        "re-export of the 0.21 path of the sealer, which now lives in loomflow.agent._sealing; "
        "nothing in loomflow imports it (checked below)"
    ),
}

# Arrows left out of the circle check, each with the reason it has to exist.
ALLOWED_BACK_EDGES = {
    ("loomflow.runtime._legacy", "loomflow.messages"): (
        "importing a 0.20 journal reads its ModelResponse rows, a type that loomflow.messages "
        "registers with loomflow.runtime.codec; importing that codec runs loomflow.runtime's "
        "__init__, which loads _legacy. Goes away when the codec leaves the runtime package "
        "or the 0.20 importer leaves the runtime"
    ),
}

# Modules that import by a computed name, and why that adds no arrow inside loomflow beyond
# those read here.
DYNAMIC_IMPORTS = {
    "loomflow": "lazy public names: the modules in loomflow._LAZY, added as arrows below",
    "loomflow.models._retry": "the provider SDKs' error modules, outside loomflow",
    "loomflow.cli.main": "its own subcommand modules, loomflow.cli.<name>",
    "loomflow.cli.worker": "the application `loomflow worker APP` names, outside loomflow",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _import_nodes(other)
            continue
        yield child
        yield from _import_nodes(child)


def _is_dynamic_import(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def _named(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names (a ``from`` import of a submodule names it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join([*parts[: len(parts) - node.level + 1], node.module or ""]).strip(".")
    else:
        base = node.module or ""
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _arrows(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    named: list[str] = []
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            named.extend(_named(module, node))
        elif _is_dynamic_import(node):
            assert module in DYNAMIC_IMPORTS, f"{module} imports by a computed name"
    if module == "loomflow":
        named.extend(f"loomflow{relative}" for relative in loomflow._LAZY.values())
    arrows: set[str] = set()
    for name in named:
        if name not in MODULES:
            continue  # a name imported from a module, or outside loomflow
        parts = name.split(".")
        # The module itself and each package __init__ that importing it runs.
        for end in range(2, len(parts) + 1):
            target = ".".join(parts[:end])
            if module != target and not module.startswith(target + "."):
                arrows.add(target)
    return arrows


GRAPH = {module: _arrows(module) for module in MODULES}


def _within(module: str, packages: tuple[str, ...] | list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its modules in order, the first repeated last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_graph_is_read_whole() -> None:
    # Guards the reader itself: known arrows, a lazy one and a package __init__ one among them.
    assert "loomflow.hooks" in GRAPH["loomflow.agent._agent"]
    assert "loomflow.runtime._legacy" in GRAPH["loomflow.runtime._sql"]  # lazy or not, counted
    assert "loomflow.runtime" in GRAPH["loomflow.messages"]  # via loomflow.runtime.codec
    assert "loomflow.agent" in GRAPH["loomflow"]  # the lazy public names
    assert len(GRAPH) > 100


def test_the_reader_finds_a_circle_and_names_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _a_cycle(graph) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back() -> None:
    graph = {
        module: {t for t in targets if (module, t) not in ALLOWED_BACK_EDGES}
        for module, targets in GRAPH.items()
    }
    cycle = _a_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())
    for (source, target), reason in ALLOWED_BACK_EDGES.items():
        assert target in GRAPH[source], f"{source} -> {target} is gone: drop it ({reason})"


def _floor(module: str) -> int:
    floors = [
        i
        for i, names in enumerate(FLOORS)
        for name in names
        if module == name or (name != "loomflow" and module.startswith(name + "."))
    ]
    assert len(floors) == 1, f"{module} stands on {len(floors)} floors: place it in FLOORS"
    return floors[0]


def test_every_module_imports_only_its_floor_or_below() -> None:
    upward = {
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if _floor(target) > _floor(module)
    }
    known = set(ALLOWED_BACK_EDGES) | {("loomflow.audit.sealing", "loomflow.agent._sealing")}
    # The audit.sealing re-export also runs loomflow.agent's __init__ on the way.
    known.add(("loomflow.audit.sealing", "loomflow.agent"))
    assert sorted(upward - known) == []


def test_the_low_layers_import_nothing_above_them() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if _within(module, LOW_LAYERS)
        for target in targets
        if _within(target, HIGH_LAYERS)
    )
    assert wrong == []


def test_only_the_top_the_cli_and_named_helpers_import_the_agent() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if not _within(module, ["loomflow.agent", *AGENT_IMPORTERS])
        for target in targets
        if _within(target, ["loomflow.agent"])
    )
    assert wrong == []
    # The re-export is a leaf: nothing inside loomflow goes through it to the agent.
    assert not [m for m, targets in GRAPH.items() if "loomflow.audit.sealing" in targets]
    # Every named importer still does (else its entry above has outlived its reason).
    for importer in AGENT_IMPORTERS:
        assert any(
            _within(target, ["loomflow.agent"])
            for module, targets in GRAPH.items()
            if module == importer or (importer != "loomflow" and _within(module, [importer]))
            for target in targets
        ), importer


def test_the_hook_contract_stands_below_its_users() -> None:
    # Governance, audit and telemetry implement hooks without the agent; the agent calls them.
    for user in ("loomflow.governance", "loomflow.audit._log", "loomflow.telemetry._hooks"):
        users = [m for m in GRAPH if _within(m, [user])]
        assert any("loomflow.hooks" in GRAPH[m] for m in users), user
    assert not _within("loomflow.hooks", HIGH_LAYERS)
    assert "loomflow.redaction" in GRAPH["loomflow.hooks"]


def test_importing_the_errors_loads_neither_the_agent_nor_any_sdk() -> None:
    # A fresh interpreter, so nothing another test imported counts.
    code = (
        "import sys, loomflow.errors; "
        "print('\\n'.join(m for m in sys.modules if m.split('.')[0] in "
        "('loomflow', 'pydantic', 'opentelemetry', 'prometheus_client', 'anthropic', "
        "'openai', 'aiosqlite', 'asyncpg')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    # _printable (stdlib only) spells ids in the errors' messages.
    assert sorted(out) == [
        "loomflow",
        "loomflow._ids",
        "loomflow._printable",
        "loomflow.context",
        "loomflow.errors",
    ]


def test_the_lazy_top_level_names_are_the_documented_ones() -> None:
    assert set(loomflow._LAZY) <= set(loomflow.__all__)
    for name, module in loomflow._LAZY.items():
        assert getattr(loomflow, name) is getattr(importlib.import_module(module, "loomflow"), name)
