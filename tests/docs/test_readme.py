"""The README: its quick start is what CI runs; its size and what it names (the site,
the fast lane); its Use snippet is seeded and prints its loss; what it says to set for
one-process runs. Every Python snippet of the README (and of the docs) runs in
test_readme_snippets.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import conveyor.cli.launch
from tests.docs.test_readme_snippets import readme_snippet
from tests.support.helpers import reset_context

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quick_start() -> list[str]:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "the quick start needs a code block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_is_a_page_long() -> None:
    size = len(README.read_bytes())
    assert size <= 8 * 1024, f"README.md is {size} bytes; move detail into docs/"


def test_readme_names_the_site_and_the_fast_lane() -> None:
    text = README.read_text(encoding="utf-8")
    assert "mkdocs serve" in text
    assert '`OMP_NUM_THREADS=1 python -m pytest -q -m "not slow" -n 2`' in text


def test_quick_start_is_two_commands_with_pinned_torch() -> None:
    commands = quick_start()
    assert len(commands) == 2, commands
    assert all('"torch==2.13.0"' in c for c in commands), commands
    assert "conveyor demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quick_start()[1] in ci


# --- the Use snippet, and what to set for one-process runs --------------------------------

USE = "import torch, conveyor\nfrom torch import nn"


def test_the_use_snippet_is_seeded_and_prints_its_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = readme_snippet(USE)
    printed = []
    for _ in range(2):
        reset_context()  # a fresh script
        exec(compile(code, "README.md", "exec"), {})
        printed.append(capsys.readouterr().out)
    lines = printed[0].splitlines()
    assert len(lines) == 3 and all(re.fullmatch(r"loss \d+\.\d{4}", line) for line in lines)
    assert printed[1] == printed[0]  # seeded: every run (and every rank) has the same data


def test_the_readme_says_what_to_set_for_one_process_runs() -> None:
    text = README.read_text()
    use = text.split("## Use", 1)[1].split("\n## ", 1)[0]
    commands = [" ".join(c.split()) for c in re.findall(r"`([^`]+python train\.py)`", use)]
    assert commands, "the Use section should say what to set for python train.py"
    words = shlex.split(commands[0])
    assert words[-2:] == ["python", "train.py"]
    settings = dict(word.split("=", 1) for word in words[:-2])
    want = {"OMP_NUM_THREADS": "1"} | {n: str(1 << 30) for n in conveyor.cli.launch.MALLOC_TUNABLES}
    assert settings == want  # exactly what conveyor launch sets
