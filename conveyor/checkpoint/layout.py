"""The checkpoint directory: checkpoint names, the ``latest`` pointer and the atomic commit.

``path/latest`` names the current checkpoint ``path/step-<step>-<hex>/`` (or
``path/nostep-<hex>/``); a save writes ``path/<name>.tmp`` and :func:`commit` renames it
and replaces ``latest``, then removes older checkpoints and leftovers of failed saves.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from conveyor.storage import LATEST, META, resolve

__all__ = ["LATEST", "META", "commit", "new_name", "resolve"]


def new_name(step: int | None) -> str:
    """A fresh checkpoint directory name: ``step-<step>-<hex>`` or ``nostep-<hex>``."""
    prefix = f"step-{step:08d}" if step is not None else "nostep"
    return f"{prefix}-{secrets.token_hex(4)}"


def _fsync_dir(path: Path) -> None:
    """Flush directory ``path``'s entries to disk (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(root: Path, ckpt_name: str, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote ``root/<ckpt_name>.tmp``: write ``meta`` into it and
    make it the current checkpoint."""
    tmp = root / f"{ckpt_name}.tmp"
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, root / ckpt_name)
    _fsync_dir(root)
    pointer = root / f"{LATEST}.{ckpt_name}.tmp"
    with open(pointer, "w") as f:
        f.write(ckpt_name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)  # the commit point
    _fsync_dir(root)
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
