"""mkdocs hook: the `--help` of conveyor's commands, generated when the site is built.

A page writes ``<!-- conveyor-help: simulate -->`` (or ``demo``, ``launch``, ``plan``,
``trace``, or nothing after the colon for ``conveyor --help`` itself) on a line of its own;
the build replaces it with what ``conveyor simulate --help`` prints, so the reference never
drifts from the parsers. tests/docs/test_docs.py checks that every command has its marker.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any

MARKER = re.compile(r"^<!-- conveyor-help:\s*([a-z]*)\s*-->$", re.M)
WIDTH = 88  # columns argparse wraps to, whatever the terminal that builds the site


def help_text(command: str) -> str:
    """What ``conveyor COMMAND --help`` prints (``conveyor --help`` for ``""``).

    Args:
        command: A subcommand name, or ``""`` for the top-level command.

    Returns:
        The help text, as argparse formats it at :data:`WIDTH` columns.
    """
    from conveyor.cli.command import main

    argv = [command, "--help"] if command else ["--help"]
    saved = dict(os.environ)  # `launch` sets its defaults (OMP_NUM_THREADS, ...) here
    os.environ.update(COLUMNS=str(WIDTH), LINES="50")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = out.getvalue().rstrip()
    if not text:
        raise RuntimeError(f"'conveyor {command} --help' printed nothing")
    return text


def render(command: str) -> str:
    """The marker's replacement: the command line and its help in a text block."""
    shown = f"conveyor {command} --help" if command else "conveyor --help"
    return f"```text\n$ {shown}\n{help_text(command)}\n```"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace every help marker of a page with the live help text."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
