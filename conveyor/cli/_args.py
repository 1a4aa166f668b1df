"""Argument parsing shared by conveyor's commands: one-line usage errors, help that
shows defaults, docstrings as plain text."""

from __future__ import annotations

import argparse
import re
from typing import NoReturn


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Print ``message`` as one usage error line and exit with code 2."""
    parser.exit(2, f"{parser.prog}: error: {message}; see '{parser.prog} --help'\n")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2).

    The line says what was wrong and where to read more, without argparse's usage block.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with code 2.

        Args:
            message: What was wrong (argparse's message).

        Raises:
            SystemExit: Always, with code 2.
        """
        _fail(self, message)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give a parser made elsewhere (torchrun's) :class:`Parser`'s one-line errors.

    Args:
        parser: The parser; changed in place.

    Returns:
        The same parser.
    """
    setattr(parser, "error", lambda message: _fail(parser, message))  # noqa: B010
    return parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A help formatter that keeps the description's line breaks and shows defaults.

    Appends "(default: X)" to every option whose default says something (not None or
    False) and whose help names none.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        """``action``'s help, with its default appended where it says something."""
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain(text: str) -> str:
    """Docstring text for ``--help``, without reStructuredText markup.

    Args:
        text: A docstring.

    Returns:
        The text without double backticks, without roles around names (the names are
        kept), and with one ``:`` for the ``::`` before a literal block.
    """
    text = _ROLE.sub(r"\1", text).replace("``", "")
    return re.sub(r"::$", ":", text, flags=re.M)


def subcommand(prog: str, doc: str | None) -> Parser:
    """The parser of subcommand ``prog``: its help is its module's docstring without the
    usage line (the first paragraph), in :class:`HelpFormatter`'s layout."""
    return Parser(
        prog=prog,
        description=plain((doc or "").split("\n\n", 1)[-1]),
        formatter_class=HelpFormatter,
    )
