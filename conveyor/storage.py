"""Checkpoints on disk: the atomic commit every writer uses (:func:`commit`,
:func:`write_atomically`), and a conveyor checkpoint as read back (the ``latest`` pointer,
conveyor.json's format and DCP's metadata, DCP's reads made quiet and their failures
:class:`~conveyor.errors.CheckpointError`). Below the checkpoints and the pipeline, so that
``weights=`` reads a checkpoint tensor by tensor while a pipeline is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from conveyor.errors import CheckpointError

LATEST = "latest"
"""The file in a checkpoint directory that names the current checkpoint."""
META = "conveyor.json"
"""conveyor's own metadata file in each checkpoint."""
FORMAT = "conveyor-checkpoint"
"""The ``format`` entry of every conveyor.json."""
VERSION = 1
"""The ``version`` entry this conveyor writes; it reads this version and older ones."""


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file's bytes, or a directory's entries) to disk. A directory whose
    file system cannot flush one (some refuse: EINVAL) is left as it is."""
    is_dir = os.path.isdir(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if is_dir:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not is_dir:
            raise
    finally:
        os.close(fd)


def commit(partial: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Make ``partial`` (a file or a directory, written whole) ``final``, durably: flush it,
    rename it over ``final`` (atomic on POSIX: a reader sees the old one or the new one),
    then flush the directory that holds the new name, so that the rename itself survives a
    crash. Every checkpoint writer (``conveyor.save``, ``save_pretrained``, ``conveyor
    convert``) ends each file and directory it writes here."""
    fsync(partial)
    os.replace(partial, final)
    fsync(Path(final).parent)


def write_atomically(final: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """``write(path)`` into a temporary file beside ``final``, then :func:`commit` it as
    ``final``; if anything fails, the temporary file is removed and ``final`` is as it was."""
    target = Path(final)
    partial = target.with_name(target.name + ".tmp")
    try:
        write(partial)
        commit(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text(final: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` as the file ``final`` atomically (:func:`write_atomically`)."""
    write_atomically(final, lambda path: path.write_text(text))


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a checkpoint to resume from (unfinished saves do not count).

    Args:
        path: A directory given to :func:`conveyor.save`, or one checkpoint's directory in it.

    Returns:
        True if ``path/latest`` exists (also when it names a checkpoint that has gone
        missing, so that a resuming script calls :func:`conveyor.load` and stops with that
        error instead of silently starting over) or ``path`` is itself a checkpoint.
    """
    root = Path(path)
    return (root / LATEST).is_file() or (root / META).is_file()


def resolve(path: str | os.PathLike[str]) -> Path:
    """The directory of the current checkpoint at ``path``."""
    root = Path(path)
    latest = root / LATEST
    if latest.is_file():
        ckpt_name = latest.read_text().strip()
        current = root / ckpt_name
        if not (current / META).is_file():
            raise CheckpointError(
                f"{latest} names {ckpt_name!r}, but {current / META} is missing: the checkpoint "
                f"was deleted or moved; restore it or start from another checkpoint"
            )
        return current
    if (root / META).is_file():
        return root  # a checkpoint directory itself (path/step-...)
    if not root.exists():
        raise CheckpointError(
            f"no checkpoint at {root}: the path does not exist; check it, or start "
            f"without loading (conveyor.checkpoint.exists(path) tells whether one is there)"
        )
    unfinished = sorted(p.name for p in root.glob("*.tmp"))
    hint = f" (it holds only unfinished saves: {', '.join(unfinished)})" if unfinished else ""
    raise CheckpointError(
        f"no checkpoint at {root}: no {LATEST} file{hint}; pass a directory written by "
        f"conveyor.save, or start without loading"
    )


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], Metadata]:
    """The current checkpoint's directory, its conveyor.json and DCP's metadata."""
    ckpt_dir = resolve(path)
    meta = json.loads((ckpt_dir / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir / META} is not a conveyor checkpoint's metadata")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{ckpt_dir} was written by a newer conveyor (format {meta['version']}); upgrade "
            f"conveyor to load it"
        )
    metadata = FileSystemReader(ckpt_dir).read_metadata()
    return ckpt_dir, meta, metadata


def without_weights(ckpt_dir: Path) -> str:
    """The error for reading weights from a checkpoint saved without them."""
    return (
        f"checkpoint {ckpt_dir} holds optimizer state only (PipelineTrainer keeps the "
        f"weights beside it, in the transformers directory of the same checkpoint-N); read "
        f"the weights from that directory (weights=, from_pretrained)"
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns that it runs in one process whenever ``no_dist`` is set; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        yield


@contextlib.contextmanager
def dcp_errors(doing: str, then: str) -> Iterator[None]:
    """DCP's failures (a ``BaseException`` carrying every rank's error) as CheckpointError."""
    try:
        yield
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        first, _ = exc.failures[ranks[0]]
        # from None: the message carries the first rank's error; DCP's own exception
        # would print every rank's traceback above ours.
        raise CheckpointError(
            f"{doing} failed on rank(s) {ranks}: {type(first).__name__}: {first}; {then}"
        ) from None
