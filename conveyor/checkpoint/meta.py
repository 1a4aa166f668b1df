"""``conveyor.json``, each checkpoint's own metadata: writing it, and reading a checkpoint's
metadata (ours and DCP's) back with its format checked."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from conveyor.checkpoint.errors import CheckpointError
from conveyor.checkpoint.layout import META, _resolve
from conveyor.checkpoint.view import _View

FORMAT = "conveyor-checkpoint"
VERSION = 1


def _meta(
    infos: list[dict[str, Any]],
    canon: dict[str, str],
    writer: dict[str, int],
    view: _View,
    step: int | None,
) -> dict[str, Any]:
    """conveyor.json: step, names in model order, aliases, optimizer hyperparameters."""
    order = sorted({(s, pos, n) for i in infos for names, _ in i["entries"] for s, pos, n in names})
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
    if infos[0]["class"] is None:
        return meta
    groups: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    group_of: dict[str, int] = {}
    with_state: list[str] = []
    for rank, info in enumerate(infos):
        for (names, _), g, has in zip(
            info["entries"], info["group_of"], info["has_state"], strict=True
        ):
            c = canon[names[0][2]]
            if writer[c] != rank or g is None or c in group_of:
                continue
            hyper = info["groups"][g]
            key = json.dumps(hyper, sort_keys=True)
            if key not in seen:
                seen[key] = len(groups)
                groups.append(hyper)
            group_of[c] = seen[key]
            if has:
                with_state.append(c)
    meta["optimizer"] = {
        "class": infos[0]["class"],
        "param_groups": groups,
        "group_of": group_of,
        "with_state": with_state,
    }
    return meta


def _read(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], Metadata]:
    where = _resolve(path)
    meta = json.loads((where / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where / META} is not a conveyor checkpoint's metadata")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{where} was written by a newer conveyor (format {meta['version']}); upgrade "
            f"conveyor to load it"
        )
    metadata = FileSystemReader(where).read_metadata()
    return where, meta, metadata
