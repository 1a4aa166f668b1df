"""Stored names: which of a tensor's names is canonical, and which rank writes it."""

from __future__ import annotations

from typing import Any


def components(reports: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, int]]:
    """From every rank's report of its entries: canonical name of every name, and the
    writing rank of every canonical name (the lowest rank holding any copy)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        """The representative of ``x``'s set of names (union-find with path halving)."""
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        """Merge the sets of ``a`` and ``b``."""
        rep_a, rep_b = find(a), find(b)
        if rep_a != rep_b:
            parent[max(rep_a, rep_b)] = min(rep_a, rep_b)

    linked: dict[tuple[int, ...], str] = {}
    first: dict[str, tuple[int, int, str]] = {}
    for report in reports:
        for names, link in report["entries"]:
            for s, pos, name in names:
                union(names[0][2], name)
                first[name] = min(first.get(name, (s, pos, name)), (s, pos, name))
            if link is not None:
                union(linked.setdefault(tuple(link), names[0][2]), names[0][2])
    best: dict[str, tuple[int, int, str]] = {}
    for name, occurrence in first.items():
        representative = find(name)
        best[representative] = min(best.get(representative, occurrence), occurrence)
    canon = {name: best[find(name)][2] for name in first}
    writer: dict[str, int] = {}
    for rank, report in enumerate(reports):
        for names, _ in report["entries"]:
            writer.setdefault(canon[names[0][2]], rank)
    return canon, writer
