"""The package's import graph: layers whose arrows point one way, and no cycle.

Every import of a ``conveyor`` module counts, at the top of a file or inside a function,
and so does an import under ``if TYPE_CHECKING:`` (a cycle through annotations is still
a cycle to a reader). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
first, so it counts as importing those too.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2] / "conveyor"


def _load_hook() -> Any:
    """The hook that writes the layout page: its layers are the ones tested here (one list
    for the page and for this test)."""
    path = ROOT.parent / "docs" / "hooks" / "layout.py"
    spec = importlib.util.spec_from_file_location("conveyor_docs_layout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Top to bottom: a module may import from its own layer or a lower one, never a higher.
# The root package is a facade of lazy names over everything (it imports only errors
# and partition.cuts itself).
LAYERS: list[list[str]] = [units for _, units in _load_hook().LAYERS]
LAYER = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The layer unit of a module: a top-level module or a subpackage of conveyor."""
    return ".".join(module.split(".")[:2])


def _module_of(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """The conveyor modules ``module`` imports, with the line of each import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [name if name in MODULES else base for name in names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "conveyor":
                continue
            target = _module_of(name)
            while target:  # importing a.b.c runs a and a.b first
                if target != module and not module.startswith(target + "."):
                    yield target, node.lineno
                target = target.rpartition(".")[0]


GRAPH = {module: sorted({t for t, _ in _imports(module)}) for module in MODULES}


def test_every_module_has_a_layer() -> None:
    assert sorted(m for m in MODULES if _unit(m) not in LAYER) == []


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{module}:{line} imports {target} ({_unit(module)} is above {_unit(target)})"
        for module in MODULES
        for target, line in _imports(module)
        if LAYER[_unit(target)] < LAYER[_unit(module)]
    ]
    assert upward == []


def test_only_the_top_layer_imports_the_root_facade() -> None:
    # `import conveyor` then `conveyor.Pipeline(...)` hides an arrow to any layer.
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            direct = (
                isinstance(node, ast.Import) and "conveyor" in [a.name for a in node.names]
            ) or (isinstance(node, ast.ImportFrom) and node.module == "conveyor" and not node.level)
            if direct and _unit(module) not in LAYERS[0]:
                users.append(f"{module}:{node.lineno}")
    assert users == []


def _cycle() -> list[str] | None:
    """One import cycle among the modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in GRAPH[module]:
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(MODULES):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_no_import_cycle_between_modules() -> None:
    cycle = _cycle()
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycle_between_layers() -> None:
    edges = {
        (_unit(module), _unit(target))
        for module, targets in GRAPH.items()
        for target in targets
        if _unit(module) != _unit(target)
    }
    same_layer = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert same_layer == []


def test_the_layout_page_lists_every_module_with_its_docstring() -> None:
    page = (ROOT.parent / "docs" / "concepts" / "layout.md").read_text()
    assert "\n<!-- conveyor-layout -->\n" in page
    hook = _load_hook()
    text = hook.render()
    for path in MODULES.values():
        shown = path.relative_to(ROOT.parent).as_posix()
        assert f"| `{shown}` | " in text, f"{shown} is missing from the layout page"
        assert hook.summary(path), f"{shown} has no docstring to describe it on the page"


FIRST_IMPORT = """
import importlib, sys
from importlib.machinery import SourceFileLoader

# Each module's source is compiled once, as a bytecode cache would keep it (the
# environment may forbid writing .pyc files); every import still executes it afresh.
compiled = {}
compile_source = SourceFileLoader.source_to_code

def source_to_code(self, data, path, *args, **kwargs):
    key = (path, bytes(data))
    if key not in compiled:
        compiled[key] = compile_source(self, data, path, *args, **kwargs)
    return compiled[key]

SourceFileLoader.source_to_code = source_to_code
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "conveyor" or m.startswith("conveyor.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if (error.name or "").startswith("conveyor"):
            failed.append(f"{name}: {error!r}")
    except Exception as error:  # an import cycle shows as ImportError / AttributeError
        failed.append(f"{name}: {error!r}")
print("\\n".join(failed))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_module_imports_first() -> None:
    # What the graph above says, seen by Python: each module imported with no other
    # conveyor module loaded yet (a missing optional dependency is skipped).
    names = sorted(m for m in MODULES if not m.endswith("__main__"))  # those run a command
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT, *names],
        capture_output=True, text=True, timeout=300, cwd=ROOT.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout
