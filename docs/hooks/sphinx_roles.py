"""griffe extension: Sphinx roles in conveyor's docstrings, written as links mkdocstrings
renders.

conveyor's docstrings are Google style but name other objects the Sphinx way
(``:func:`balance```, ``:class:`~conveyor.schedules.Schedule```) and introduce literal
blocks with ``::``. Markdown shows those roles as stray text, so before rendering this
extension turns each role into an optional cross-reference: a link where the object has a
page on the site, plain code where it does not (private helpers). Relative names are
looked up the way Python would from the docstring's object: its members, its class, its
module. ``text::`` before an indented block becomes ``text:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|mod|attr|exc|obj|const):`([^`]+)`")
LITERAL = re.compile(r"::$", re.M)


def _path(member: Any) -> str:
    """An object's canonical path (an alias's target)."""
    return str(getattr(member, "target_path", None) or member.path)


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` refers to from ``obj``'s docstring, or None."""
    if name.startswith("conveyor.") or name == "conveyor":
        return name
    head, _, rest = name.partition(".")
    scope: Any = obj
    while scope is not None:
        members = getattr(scope, "members", {})
        if head in members:
            member = members[head]
            if not member.is_alias and member.is_module and head in member.members:
                # a submodule named like the function it defines (schedules.gpipe.gpipe):
                # the package re-exports the function, so link that
                member = member.members[head]
            found = _path(member)
            return f"{found}.{rest}" if rest else found
        scope = scope.parent
    return None


def _link(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match.group(1).strip()
    short = target.startswith("~")
    target = target.lstrip("~").removesuffix("()")
    shown = target.rsplit(".", 1)[-1] if short else target
    identifier = _resolve(obj, target)
    code = f"<code>{shown}</code>"
    if identifier is None:
        return code
    return f'<autoref identifier="{identifier}" optional>{code}</autoref>'


def rewrite(obj: griffe.Object) -> None:
    """Rewrite ``obj``'s docstring and its members', recursively."""
    if obj.docstring is not None:
        text = ROLE.sub(lambda m: _link(obj, m), obj.docstring.value)
        obj.docstring.value = LITERAL.sub(":", text)
    for member in obj.members.values():
        if not member.is_alias:
            rewrite(member)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        rewrite(pkg)
