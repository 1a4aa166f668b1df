"""The checkpoint directory: checkpoint names, the ``latest`` pointer and the atomic commit.

``path/latest`` names the current checkpoint ``path/step-<step>-<hex>/`` (or
``path/nostep-<hex>/``); a save writes ``path/<name>.tmp`` and :func:`commit` renames it
and replaces ``latest``, then removes older checkpoints and leftovers of failed saves.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

from conveyor.storage import LATEST, META, resolve, write_text
from conveyor.storage import commit as commit_path

__all__ = ["LATEST", "META", "commit", "new_name", "resolve"]


def new_name(step: int | None) -> str:
    """A fresh checkpoint directory name: ``step-<step>-<hex>`` or ``nostep-<hex>``."""
    prefix = f"step-{step:08d}" if step is not None else "nostep"
    return f"{prefix}-{secrets.token_hex(4)}"


def commit(root: Path, ckpt_name: str, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote ``root/<ckpt_name>.tmp``: write ``meta`` into it and
    make it the current checkpoint (each step through :func:`conveyor.storage.commit`)."""
    tmp = root / f"{ckpt_name}.tmp"
    write_text(tmp / META, json.dumps(meta, indent=1))
    commit_path(tmp, root / ckpt_name)
    pointer = root / f"{LATEST}.{ckpt_name}.tmp"  # its own name: saves never share one
    pointer.write_text(ckpt_name + "\n")
    commit_path(pointer, root / LATEST)  # the commit point
    # Older checkpoints and leftovers of saves that died; only names this module writes.
    for old in root.iterdir():
        if old.name == ckpt_name:
            continue
        if (
            old.is_dir()
            and old.name.startswith(("step-", "nostep-"))
            and (old.name.endswith(".tmp") or (old / META).is_file())
        ):
            shutil.rmtree(old, ignore_errors=True)
        elif old.is_file() and old.name.startswith(f"{LATEST}.") and old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)
