"""``conveyor.json``, each checkpoint's own metadata: writing it, and reading a checkpoint's
metadata (ours and DCP's) back with its format checked."""

from __future__ import annotations

import json
from typing import Any

from conveyor.checkpoint.view import View
from conveyor.storage import FORMAT, VERSION, read_checkpoint

__all__ = ["build_meta", "read_checkpoint"]


def build_meta(
    reports: list[dict[str, Any]],
    canon: dict[str, str],
    writer: dict[str, int],
    view: View,
    step: int | None,
) -> dict[str, Any]:
    """conveyor.json from every rank's report: step, names in model order, aliases,
    optimizer hyperparameters."""
    order = sorted(
        {(s, pos, n) for r in reports for names, _ in r["entries"] for s, pos, n in names}
    )
    keys = list(dict.fromkeys(n for _, _, n in order))
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "saved_by": view.layout,
        "keys": keys,
        "aliases": {n: c for n, c in canon.items() if n != c},
        "optimizer": None,
    }
    if reports[0]["class"] is None:
        return meta
    param_groups: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    group_of: dict[str, int] = {}
    with_state: list[str] = []
    for rank, report in enumerate(reports):
        for (names, _), g, has in zip(
            report["entries"], report["group_of"], report["has_state"], strict=True
        ):
            c = canon[names[0][2]]
            if writer[c] != rank or g is None or c in group_of:
                continue
            hyper = report["param_groups"][g]
            hyper_text = json.dumps(hyper, sort_keys=True)
            if hyper_text not in seen:
                seen[hyper_text] = len(param_groups)
                param_groups.append(hyper)
            group_of[c] = seen[hyper_text]
            if has:
                with_state.append(c)
    meta["optimizer"] = {
        "class": reports[0]["class"],
        "param_groups": param_groups,
        "group_of": group_of,
        "with_state": with_state,
    }
    return meta
