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
transformers' own ``save_pretrained`` writes it: each tensor through transformers' reverse
weight conversion, so ``from_pretrained`` of the published class reads it.

conveyor writes the files itself rather than through torch's ``HuggingFaceStorageWriter``:
that writer stores each rank's shards first and consolidates them in a second pass (the
model written twice, both copies on disk at once), and it cannot apply the reverse
conversion, which needs each expert tensor whole.

Commit: every file is written under a temporary name and renamed once complete; new shards
never reuse the name of a file the directory's current index lists; rank 0 replaces the
index last (``os.replace``), then removes what the old index listed and the new does not.
Until that moment the directory reads as the previous checkpoint, after it as the new one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from conveyor.checkpoint.dcp import is_sharded
from conveyor.checkpoint.errors import CheckpointError
from conveyor.checkpoint.naming import components
from conveyor.checkpoint.safetensors_file import (
    INDEX,
    SINGLE,
    FileWriter,
    TensorInfo,
    pack,
    parse_size,
    read_weight_map,
    shard_names,
    write_index,
)
from conveyor.checkpoint.view import View, all_gather, broadcast, is_pipeline, raise_any, view_of
from conveyor.errors import ConfigError

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline

__all__ = ["save_pretrained", "write"]

CONFIGS = ("config.json", "generation_config.json")
# What marks a directory as a checkpoint (or a transformers run's output) to write into.
MARKS = (INDEX, SINGLE, *CONFIGS, "pytorch_model.bin", "pytorch_model.bin.index.json")
SHARD = re.compile(r"model-(?:[0-9a-f]{8}-)?\d{5}-of-\d{5}\.safetensors(?:\.tmp)?")


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
    infos = [info for e in mine for info in published.infos(canon[e.names[0][2]], e.value)]
    plans = all_gather(view, [(i.name, i.nbytes) for i in infos])
    raise_any(view, refusal)

    files = [pack(plan, limit) for plan in plans]
    count = sum(len(f) for f in files)
    names_of, taken = {}, 0
    for rank_files in files:
        for group in rank_files:
            for n in group:
                names_of[n] = taken
            taken += 1
    tag = broadcast(view, _tag(root, count) if view.rank == 0 else None)
    file_names = shard_names(count, tag)
    weight_map = {n: file_names[i] for n, i in names_of.items()}

    error = None
    done: list[Path] = []
    writers: dict[int, FileWriter] = {}
    left = {i: len(g) for i, g in enumerate(f for rf in files for f in rf)}
    by_name = {i.name: i for i in infos}
    try:
        for e, whole in _whole_values(view, canon, writer):
            if error is not None or id(e) not in writes:
                continue
            c = canon[e.names[0][2]]
            target = ""
            try:
                for name, value in published.convert(c, whole):
                    index = names_of[name]
                    target = str(root / file_names[index])
                    if index not in writers:
                        writers[index] = FileWriter(
                            root / file_names[index],
                            [by_name[n] for n in files_of(files, index)],
                        )
                    writers[index].write(name, value)
                    left[index] -= 1
                    if left[index] == 0:
                        writers.pop(index).close()
                        done.append(root / file_names[index])
            except OSError as exc:
                # raise_any names the rank of a distributed world's errors
                who = "" if view.distributed else "rank 0: "
                error = f"{who}writing {target or root} failed: {exc.strerror or exc}"
    finally:
        for w in writers.values():
            with contextlib.suppress(OSError):
                w.abort()
    try:
        raise_any(view, error)
    except CheckpointError as exc:
        for p in done:  # listed by no index
            p.unlink(missing_ok=True)
        raise CheckpointError(f"{exc}; {root} keeps its previous checkpoint") from None

    commit_error = None
    if view.rank == 0:
        try:
            _commit(root, model, weight_map, sum(b for p in plans for _, b in p))
        except OSError as exc:
            commit_error = f"committing {root} failed: {exc}; it keeps its previous checkpoint"
        if skipped:
            warnings.warn(
                f"save_pretrained wrote no value for {skipped[:3]} (not tensors: a module's "
                f"extra state, which safetensors cannot hold); conveyor.save keeps them",
                stacklevel=2,
            )
    commit_error = broadcast(view, commit_error)
    if commit_error:
        raise CheckpointError(commit_error)


def files_of(files: list[list[list[str]]], index: int) -> list[str]:
    """The tensor names of the ``index``-th file of the whole directory."""
    return [f for rank_files in files for f in rank_files][index]


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
        if present and not any(m in present for m in MARKS):
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


def _tag(root: Path, count: int) -> str:
    """What the new shards' names carry so that none is a file the directory holds now
    (its current checkpoint stays whole until the new index replaces the old)."""
    if any((root / n).exists() for n in shard_names(count)):
        return secrets.token_hex(4)
    return ""


def _commit(root: Path, model: nn.Module, weight_map: dict[str, str], total: int) -> None:
    """Rank 0, once every shard is on disk: the configs, then the index (the commit
    point), then remove what only the previous checkpoint used."""
    old = set(read_weight_map(root).values())
    _write_configs(root, model)
    params = sum(p.numel() for p in model.parameters())
    write_index(root, weight_map, {"total_size": total, "total_parameters": params})
    new = set(weight_map.values())
    for p in root.iterdir():
        if p.name in new:
            continue
        if p.name in old or p.name == SINGLE or SHARD.fullmatch(p.name):
            p.unlink(missing_ok=True)


def _write_configs(root: Path, model: nn.Module) -> None:
    """The model's ``config.json`` and ``generation_config.json``, each replaced
    atomically; a model without a transformers config gets a warning instead."""
    config: Any = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        warnings.warn(
            f"save_pretrained wrote no config.json: {type(model).__name__} has no transformers "
            f"config (from_pretrained needs one; weights= reads the directory as is)",
            stacklevel=3,
        )
        return
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]  # as transformers' save_pretrained
    texts = {"config.json": config.to_json_string()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        texts["generation_config.json"] = generation.to_json_string()
    for name, text in texts.items():
        partial = root / f"{name}.tmp"
        with open(partial, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, root / name)


class Published:
    """The names and tensors a model's checkpoint holds for each of its tensors: the same
    for most; for a transformers model with weight conversions (MoE experts), what its
    ``save_pretrained`` writes (transformers' reverse conversion, tensor by tensor)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._revert: Any = None
        self._tied: list[str] = []
        self._order = {n: i for i, n in enumerate(model.state_dict(keep_vars=True))}
        self._ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return
        if not isinstance(model, PreTrainedModel):
            return
        from transformers.core_model_loading import revert_weight_conversion

        self._revert = revert_weight_conversion
        with contextlib.suppress(Exception):  # a model without tie declarations
            from transformers.modeling_utils import _get_tied_weight_keys

            self._tied = list(_get_tied_weight_keys(model))

    def preferred(self, canon: dict[str, str]) -> dict[str, str]:
        """``canon`` with each tie group stored under the name the model's own checkpoints
        use: the first in the model's order that is not a declared tied copy
        (``lm_head.weight`` of a model tying it to the embedding)."""
        groups: dict[str, list[str]] = {}
        for name, c in canon.items():
            groups.setdefault(c, []).append(name)
        out = {}
        for names in groups.values():
            ordered = sorted(names, key=lambda n: (self._order.get(n, len(self._order)), n))
            kept = [n for n in ordered if not any(re.search(p, n) for p in self._tied)]
            choice = (kept or ordered)[0]
            out.update(dict.fromkeys(names, choice))
        return out

    def _reverted(self, name: str, value: Tensor) -> dict[str, Tensor]:
        if self._revert is None:
            return {name: value}
        out: dict[str, Tensor] = self._revert(self.model, {name: value})
        return out

    def infos(self, name: str, value: Any) -> list[TensorInfo]:
        """The header entries of what ``name`` (shaped as ``value``, a DTensor's global
        shape) is stored as; nothing for an ignored name or a non-tensor."""
        if name in self._ignored or not isinstance(value, Tensor):
            return []
        meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
        return [TensorInfo.of(n, v) for n, v in self._reverted(name, meta).items()]

    def convert(self, name: str, value: Any) -> list[tuple[str, Tensor]]:
        """The stored tensors of the model's tensor ``name`` of whole value ``value``."""
        if name in self._ignored or not isinstance(value, Tensor):
            return []
        with torch.no_grad():
            return list(self._reverted(name, value.detach()).items())
