"""``conveyor.save_pretrained``: a pipeline's weights as a transformers directory, written by
every rank for what it holds, without any process holding the whole model.

Each tensor is written once, by the lowest rank holding it (as :func:`conveyor.save`
does), under the unsplit model's names, into safetensors shards of at most
``max_shard_size`` that only that rank writes; ``model.safetensors.index.json`` maps
names to files, and rank 0 writes it with the model's ``config.json`` and
``generation_config.json``. A sharded tensor (FSDP, tensor-parallel, vocabulary rows,
experts over ``ep``) is made whole among its holders one tensor at a time
(``full_tensor()``), and only when the rank writing it is one of them.

A transformers model whose layout differs from its files' (its MoE experts are one 3-D
tensor per projection, its published checkpoints one 2-D tensor per expert) is written as
transformers' own ``save_pretrained`` writes it
(:class:`~conveyor.checkpoint.published.Published`), so ``from_pretrained`` of the
published class reads it.

conveyor writes the files itself rather than through torch's ``HuggingFaceStorageWriter``:
that writer stores each rank's shards first and consolidates them in a second pass (the
model written twice, both copies on disk at once), and it cannot apply the reverse
conversion, which needs each expert tensor whole.

The directory is written in place and committed by rank 0 replacing the index
(:mod:`conveyor.checkpoint.hf_dir`): until then it reads as its previous checkpoint.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from conveyor.checkpoint.dcp import is_sharded
from conveyor.checkpoint.errors import CheckpointError
from conveyor.checkpoint.hf_dir import Shards, commit, configs_of, free_names, holds_checkpoint
from conveyor.checkpoint.naming import components
from conveyor.checkpoint.published import Published
from conveyor.checkpoint.view import View, all_gather, broadcast, is_pipeline, raise_any, view_of
from conveyor.errors import ConfigError
from conveyor.weights.safetensors_file import pack, parse_size

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline

__all__ = ["save_pretrained", "write"]


def save_pretrained(
    pipe: Pipeline | nn.Module, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> None:
    """Write the model as a transformers checkpoint directory that ``from_pretrained`` (and
    ``conveyor.Pipeline(weights=path)``) reads, every rank writing what it holds.

    A collective in a distributed world: call it on every rank. No process holds more than
    its own tensors and one whole tensor at a time; a tied weight is written once. The
    directory gets safetensors shards, ``model.safetensors.index.json``, and the model's
    ``config.json`` / ``generation_config.json`` when it has them (a model without a
    transformers config gets the weights and a warning). Atomic: a save that dies leaves the
    directory's previous checkpoint readable, never a half-written one.

    Args:
        pipe: The pipeline (or, in one process, a plain ``nn.Module``).
        path: The directory; created if missing. It may hold a previous checkpoint (it is
            replaced); another non-empty directory is refused. Every rank must see it.
        max_shard_size: The largest file, in bytes or as text (``"5GB"``, ``"500MiB"``); a
            larger tensor gets a file of its own.

    Raises:
        ConfigError: For a bad ``max_shard_size``.
        CheckpointError: If ``path`` is a file or a non-empty directory that is not a
            checkpoint, or writing fails (naming the rank and file; the previous
            checkpoint stays).
        PipelineError: If another rank does not reach the save within the time-out.
    """
    write(pipe, path, max_shard_size)


def write(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    *,
    any_directory: bool = False,
) -> None:
    """:func:`save_pretrained`; ``any_directory`` also writes into a non-empty directory
    that is not a checkpoint (a trainer's ``output_dir``, holding its runs)."""
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    view = view_of(pipe, saving=True)
    model: nn.Module = pipe.model if is_pipeline(pipe) else pipe  # type: ignore[assignment]
    root = Path(path)
    published = Published(model)

    refusal = _refusal(root, any_directory) if view.rank == 0 else None
    reports = all_gather(view, {"entries": [(e.names, e.link) for e in view.entries]})
    canon = published.preferred(components(reports)[0])
    writer: dict[str, int] = {}
    for rank, c in _writers(reports, canon):
        writer.setdefault(c, rank)
    mine = [e for e in view.entries if writer[canon[e.names[0][2]]] == view.rank]
    writes = {id(e) for e in mine}
    skipped = sorted({canon[e.names[0][2]] for e in mine if not isinstance(e.value, Tensor)})
    together = [g for g in published.groups(sorted(set(canon.values()))) if len(g) > 1]
    if together:
        raise ConfigError(
            f"save_pretrained writes one tensor at a time, but {type(model).__name__}'s "
            f"checkpoints store {together[0]} as one converted tensor; save with "
            f"conveyor.save and publish with `conveyor convert --to transformers --config DIR`"
        )
    infos = [
        info
        for e in mine
        if isinstance(e.value, Tensor)
        for info in published.infos({canon[e.names[0][2]]: e.value})
    ]
    plans = all_gather(view, [(i.name, i.nbytes) for i in infos])
    raise_any(view, refusal)

    # Each rank's tensors in files of its own, numbered in rank order.
    per_rank = [pack(plan, limit) for plan in plans]
    count = sum(len(f) for f in per_rank)
    names = broadcast(view, free_names(root, count) if view.rank == 0 else None)
    numbered = [group for rank_files in per_rank for group in rank_files]
    weight_map = {n: names[i] for i, group in enumerate(numbered) for n in group}
    start = sum(len(f) for f in per_rank[: view.rank])
    by_name = {i.name: i for i in infos}
    shards = Shards(root, [(names[start + k], [by_name[n] for n in group])
                           for k, group in enumerate(per_rank[view.rank])])  # fmt: skip

    error = None
    for e, whole in _whole_values(view, canon, writer):
        if error is not None or id(e) not in writes:
            continue  # after an error, only the collectives, so that no rank waits
        if not isinstance(whole, Tensor):
            continue  # extra state: warned about below
        target = root
        try:
            for name, value in published.revert({canon[e.names[0][2]]: whole.detach()}).items():
                target = root / shards.file_of[name]
                shards.write(name, value)
        except OSError as exc:
            # raise_any names the rank of a distributed world's errors
            who = "" if view.distributed else "rank 0: "
            error = f"{who}writing {target} failed: {exc.strerror or exc}"
    if error is not None:
        shards.abort()
    try:
        raise_any(view, error)
    except CheckpointError as exc:
        shards.abort()
        raise CheckpointError(f"{exc}; {root} keeps its previous checkpoint") from None

    commit_error = None
    if view.rank == 0:
        configs = configs_of(model)
        try:
            params = sum(p.numel() for p in model.parameters())
            total = sum(b for p in plans for _, b in p)
            metadata = {"total_size": total, "total_parameters": params}
            commit(root, weight_map, metadata, configs or {})
        except OSError as exc:
            commit_error = f"committing {root} failed: {exc}; it keeps its previous checkpoint"
        if configs is None:
            warnings.warn(
                f"save_pretrained wrote no config.json: {type(model).__name__} has no "
                f"transformers config (from_pretrained needs one; weights= reads the "
                f"directory as is)",
                stacklevel=2,
            )
        if skipped:
            warnings.warn(
                f"save_pretrained wrote no value for {skipped[:3]} (not tensors: a module's "
                f"extra state, which safetensors cannot hold); conveyor.save keeps them",
                stacklevel=2,
            )
    commit_error = broadcast(view, commit_error)
    if commit_error:
        raise CheckpointError(commit_error)


def _writers(reports: list[dict[str, Any]], canon: dict[str, str]) -> Iterator[tuple[int, str]]:
    for rank, report in enumerate(reports):
        for names, _ in report["entries"]:
            yield rank, canon[names[0][2]]


def _whole_values(
    view: View, canon: dict[str, str], writer: dict[str, int]
) -> Iterator[tuple[Any, Any]]:
    """Each entry of this rank, in order, with its whole value: a sharded tensor is made
    whole (a collective of its holders, all of which reach it in the same order) when its
    writer is one of them, and dropped after its use."""
    done: set[str] = set()
    for e in view.entries:
        c = canon[e.names[0][2]]
        value = e.value
        if is_sharded(value):
            if writer[c] not in value.device_mesh.mesh.flatten().tolist():
                continue  # another group of holders writes it
            value = value.full_tensor()
        if c in done:  # a second local copy of a tied weight
            continue
        done.add(c)
        yield e, value


def _refusal(root: Path, any_directory: bool) -> str | None:
    """Why ``root`` cannot take a checkpoint (None if it can); creates it if missing."""
    if root.exists() and not root.is_dir():
        return f"cannot save to {root}: it is a file; save_pretrained writes a directory"
    if root.is_dir() and not any_directory:
        present = [p.name for p in root.iterdir()]
        if present and not holds_checkpoint(root):
            return (
                f"{root} is a non-empty directory that holds no checkpoint (it has e.g. "
                f"{sorted(present)[:3]}); save into a new or empty directory, or an earlier "
                f"checkpoint's"
            )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {root}: {exc.strerror or exc}"
    return None
