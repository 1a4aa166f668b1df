"""The README's quick start is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "the quick start needs a code block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_quick_start_is_two_commands_with_pinned_torch() -> None:
    commands = quick_start()
    assert len(commands) == 2, commands
    assert all('"torch==2.13.0"' in c for c in commands), commands
    assert "conveyor demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quick_start()[1] in ci
