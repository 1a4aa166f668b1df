"""The documentation: the site builds without a warning, and its pages say what the code
does.

The build (``mkdocs build --strict``: no broken link, no missing reference, every page in
the navigation, the API reference from the docstrings, the command line from the parsers)
needs the ``docs`` extra, which the README's test command installs; without it that one
test is skipped and says so. The Python blocks of the pages run in
tests/docs/test_readme_snippets.py, the README's own checks in tests/docs/test_readme.py.
The rest here is quick: the links of the README and the pages, the pictures and the
commands that drew them, the schedule tables against the simulator, a command beside
every table of measurements, and every error message of the library
quoted in the troubleshooting page.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli.command import FORWARDED
from conveyor.schedules import SCHEDULE_NAMES, default_chunks, get_schedule
from conveyor.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
COMMANDS = ["", "simulate", *sorted(FORWARDED)]  # "" is `conveyor --help` itself

DOCS_EXTRA = all(
    importlib.util.find_spec(name) is not None
    for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _squash(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------ the build
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(
    not DOCS_EXTRA,
    reason="the docs extra is not installed (pip install -e '.[docs]'; the README's test "
    "command installs it), so mkdocs build --strict cannot run",
)
def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    cli = _text(site / "reference" / "cli.html")
    for command in COMMANDS:
        assert f"usage: conveyor {command}".rstrip() in cli, f"no help of 'conveyor {command}'"
    api = _text(site / "reference" / "conveyor.html")
    for name in ("conveyor.init", "conveyor.Pipeline", "conveyor.save", "conveyor.PipelineError"):
        assert f'id="{name}"' in api, name
    for page in (site / "reference").glob("*.html"):
        # Sphinx roles in docstrings are turned into links or code (docs/hooks/sphinx_roles.py)
        assert not re.search(r":(func|class|meth|data|mod|attr):", _text(page)), page.name


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_pictures_exist(page: Path) -> None:
    # mkdocs checks the pages' links too, but only where the docs extra is installed
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text(page)):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


# ------------------------------------------------------------------------------ the site
def _nav_pages() -> set[str]:
    nav = _text(ROOT / "mkdocs.yml").split("\nnav:", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))


def test_every_page_is_in_the_navigation() -> None:
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert pages == _nav_pages()


def test_the_command_line_page_has_every_command() -> None:
    page = _text(DOCS / "reference" / "cli.md")
    marked = re.findall(r"^<!-- conveyor-help:\s*([a-z]*)\s*-->$", page, re.M)
    assert sorted(marked) == sorted(COMMANDS)


def test_the_help_hook_prints_what_the_command_prints() -> None:
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import cli_help
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    text = cli_help.render("simulate")
    assert text.startswith("```text\n$ conveyor simulate --help\nusage: conveyor simulate")
    assert "--microbatches M" in text and text.endswith("\n```")
    for command in COMMANDS:
        assert cli_help.help_text(command).startswith("usage: conveyor")


# ---------------------------------------------------------------------- pictures, numbers
PNG_COMMAND = re.compile(r"--png (docs/img/[\w.-]+\.png)")


def test_every_picture_is_committed_with_the_command_that_drew_it() -> None:
    texts = {p: _text(p) for p in [README, *PAGES]}
    drawn = {name for text in texts.values() for name in PNG_COMMAND.findall(text)}
    shown = {
        str((p.parent / src).resolve().relative_to(ROOT))
        for p, text in texts.items()
        for src in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    }
    committed = {str(p.relative_to(ROOT)) for p in (DOCS / "img").glob("*.png")}
    assert drawn <= committed, f"drawn by a command but missing: {drawn - committed}"
    assert shown <= drawn, f"pictures without the command that drew them: {shown - drawn}"
    assert committed <= shown, f"committed but shown nowhere: {committed - shown}"


def _schedule_rows(text: str) -> dict[str, list[str]]:
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|(.*)\|$", text, re.M)
    return {name: [c.strip() for c in cells.split("|")] for name, cells in rows}


def _simulated(name: str) -> tuple[float, float, list[float]]:
    result = simulate(get_schedule(name, 4, 8, default_chunks(name)), (1.0, 1.0, 1.0))
    return result.makespan, result.bubble, list(result.peak_activations)


def _floats(cell: str) -> list[float]:
    return [float(v) for v in cell.split(",")]


def test_the_schedule_tables_are_what_the_simulator_says() -> None:
    table = _text(DOCS / "guide" / "schedules.md").split("| schedule | chunks | makespan", 1)[1]
    rows = _schedule_rows(table.split("\n\n", 1)[0])
    readme = _text(README).split("## Schedules", 1)[1].split("\n## ", 1)[0]
    short = _schedule_rows(readme)
    assert set(rows) == set(short) == set(SCHEDULE_NAMES)
    for name, cells in rows.items():
        makespan, bubble, peaks = _simulated(name)
        assert int(cells[0]) == default_chunks(name), name
        assert float(cells[1]) == pytest.approx(makespan), name
        assert float(cells[2]) == pytest.approx(bubble, abs=5e-5), name
        assert _floats(cells[3]) == pytest.approx(peaks), name
        assert float(short[name][2].rstrip("%")) == round(100 * bubble), name
        assert _floats(short[name][3]) == pytest.approx(peaks), name


COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:python|conveyor) [^`]+`|```bash\n")


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_a_table_of_measurements_says_which_command_made_it(page: Path) -> None:
    for section in re.split(r"^#+ ", _text(page), flags=re.M):
        rows = [line for line in section.splitlines() if line.startswith("|")]
        if any(re.search(r"\b\d+\.\d+\b", row) for row in rows):
            title = section.splitlines()[0]
            assert COMMAND.search(section), f"{page.name}, '{title}': a table without a command"


# --------------------------------------------------------------------------------- errors
ERRORS = {"ConfigError", "PipelineError", "ScheduleError", "CheckpointError"}
# The Trainer's errors belong with its page (docs/guide/trainer.md), written with it.
NOT_YET: tuple[str, ...] = ()


def _literal_parts(node: ast.expr) -> list[str] | None:
    """The constant text of a message, split where values are filled in; None when the
    message is not written out at the raise (a variable, a helper's result)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = [""]
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts[-1] += str(value.value)
            else:
                parts.append("")
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        if left is None or right is None:
            return None
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    return None


def _messages() -> list[tuple[str, str]]:
    """(file:line, the longest constant piece) of every error conveyor raises."""
    found = []
    for path in sorted((ROOT / "conveyor").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where.startswith(NOT_YET):
            continue
        for node in ast.walk(ast.parse(_text(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ERRORS or not node.args:
                continue
            parts = _literal_parts(node.args[0])
            if parts:
                piece = max((_squash(p) for p in parts), key=len)
                if len(piece) >= 16:
                    found.append((f"{where}:{node.lineno}", piece))
    return found


def test_troubleshooting_quotes_every_error() -> None:
    page = _squash(_text(DOCS / "guide" / "troubleshooting.md"))
    messages = _messages()
    assert len(messages) > 100  # the scan finds the library's errors
    missing = [f"{where}: {piece!r}" for where, piece in messages if piece not in page]
    assert not missing, "docs/guide/troubleshooting.md lacks:\n" + "\n".join(missing)
