"""Stored names: which of a tensor's names is canonical, and which rank writes it."""

from __future__ import annotations

from typing import Any


def _components(infos: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, int]]:
    """From every rank's entries: canonical name of every name, and the writing rank of
    every canonical name (the lowest rank holding any copy)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    linked: dict[tuple[int, ...], str] = {}
    first: dict[str, tuple[int, int, str]] = {}
    for info in infos:
        for names, link in info["entries"]:
            for s, pos, name in names:
                union(names[0][2], name)
                first[name] = min(first.get(name, (s, pos, name)), (s, pos, name))
            if link is not None:
                union(linked.setdefault(tuple(link), names[0][2]), names[0][2])
    best: dict[str, tuple[int, int, str]] = {}
    for name, where in first.items():
        root = find(name)
        best[root] = min(best.get(root, where), where)
    canon = {name: best[find(name)][2] for name in first}
    writer: dict[str, int] = {}
    for rank, info in enumerate(infos):
        for names, _ in info["entries"]:
            writer.setdefault(canon[names[0][2]], rank)
    return canon, writer
