"""mkdocs hook: the layout of the code, generated from the code when the site is built.

A page writes ``<!-- conveyor-layout -->`` on a line of its own; the build replaces it with
every module of ``conveyor/``, layer by layer from the top, each with the first paragraph
of its docstring. :data:`LAYERS` is also what ``tests/architecture/test_layers.py`` holds
the imports to (a module imports from its own layer or lower ones, and no import cycle
exists), so the page can neither miss a module nor describe a layering the code does not
have.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- conveyor-layout -->$", re.M)
PACKAGE = Path(__file__).resolve().parents[2] / "conveyor"

LAYERS: list[tuple[str, list[str]]] = [
    ("the user's entry points", ["conveyor", "conveyor.cli", "conveyor.launch", "conveyor.verify"]),
    ("other libraries' loops", ["conveyor.integrations"]),
    ("the training loop", ["conveyor.training"]),
    ("checkpoints", ["conveyor.checkpoint"]),
    (
        "the pipeline users touch, and what its keywords settle",
        ["conveyor.pipeline", "conveyor.module_state", "conveyor._setup"],
    ),
    ("the planner", ["conveyor.planning"]),
    (
        "what one rank runs, built from the options",
        ["conveyor._build", "conveyor._ends", "conveyor._options", "conveyor._rules"],
    ),
    ("expert parallelism: experts over the ep ranks", ["conveyor.experts"]),
    ("vocabulary parallelism: the vocabulary layers over the pp ranks", ["conveyor.vocab"]),
    ("context parallelism: each sequence over the cp ranks", ["conveyor.context_parallel"]),
    ("seeing what ran", ["conveyor.observe"]),
    ("running a schedule", ["conveyor.runtime"]),
    ("the model's values: built empty, initialized, loaded", ["conveyor.weights"]),
    ("model to stages", ["conveyor.partition"]),
    (
        "processes and losses",
        [
            "conveyor.context",
            "conveyor._world",
            "conveyor._failure",
            "conveyor._groups",
            "conveyor._mesh",
            "conveyor.losses",
        ],
    ),
    ("the simulator's public face", ["conveyor.simulate"]),
    ("schedules as data, and their simulation", ["conveyor.schedules"]),
    ("a checkpoint on disk, as read back", ["conveyor.storage"]),
    ("errors", ["conveyor.errors"]),
]
"""Top to bottom: (what the layer is, its units: top-level modules and subpackages)."""


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def unit(module: str) -> str:
    """The layer unit of a module: ``conveyor`` itself, a top-level module or a subpackage."""
    return ".".join(module.split(".")[:2])


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line, as Markdown."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1)}`", text)  # Sphinx roles
    return text.replace("``", "`").replace("|", "\\|")


def render() -> str:
    """The marker's replacement: one table per layer, top to bottom."""
    found = modules()
    out = []
    for depth, (what, units) in enumerate(LAYERS, 1):
        names = ", ".join(f"`{u}`" for u in units)
        out += [f"**{depth}. {what}**: {names}", "", "| module | what it is |", "|---|---|"]
        for name, path in found.items():
            if unit(name) in units:
                shown = path.relative_to(PACKAGE.parent).as_posix()
                out.append(f"| `{shown}` | {summary(path)} |")
        out.append("")
    return "\n".join(out).rstrip()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the layout marker of a page with the generated layout."""
    return MARKER.sub(lambda _: render(), markdown)
