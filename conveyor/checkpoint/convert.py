"""One checkpoint format into the other, tensor by tensor: a conveyor checkpoint
(:func:`conveyor.save`, any layout) into a transformers directory (safetensors files, the
index, the config), and back.

Neither direction holds more than a bounded buffer of small tensors, or one large tensor
(with its group, for the tensors transformers converts together, such as a layer's
experts), at a time:

- ``to="transformers"``: DCP reads the tensors of a batch whole (a batch: tensors up to
  :data:`BUFFER` bytes, or one larger tensor), and the streaming writer of
  :mod:`conveyor.weights.safetensors_file` writes each at its place in a file whose
  header was written first. Not torch's ``HuggingFaceStorageWriter``: it hands every
  tensor of a file to safetensors' ``save`` at once (a whole shard, up to
  ``max_shard_size``, in memory, and its bytes once more).
- ``to="conveyor"``: DCP saves a state dict of meta tensors; its planner reads each tensor
  from the safetensors files (:class:`~conveyor.weights.sources.Safetensors`, plain file
  reads, not memory maps) only when DCP writes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from conveyor.checkpoint import layout
from conveyor.checkpoint.hf_dir import Shards, commit, free_names, holds_checkpoint, read_configs
from conveyor.checkpoint.published import Published
from conveyor.errors import CheckpointError, ConfigError
from conveyor.storage import FORMAT, LATEST, VERSION, dcp_errors, exists, quiet, read_checkpoint
from conveyor.weights.converted import Converted, conversion_mapping
from conveyor.weights.empty import empty_weights
from conveyor.weights.plan import Names
from conveyor.weights.safetensors_file import (
    INDEX,
    SINGLE,
    TensorInfo,
    pack,
    parse_size,
    runs,
)
from conveyor.weights.sources import ConveyorCheckpoint, Safetensors

__all__ = ["BUFFER", "TARGETS", "Conversion", "check", "convert"]

TARGETS = ("transformers", "conveyor")
"""The formats :func:`convert` writes."""
BUFFER = 64 * 2**20
"""The most bytes of tensors read at once, unless one tensor alone is larger."""
NO_CONFIG = (
    "no config.json was written to {out}: transformers' from_pretrained needs one; pass "
    "config= (--config DIR) with the model's transformers config directory to add it"
)


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote."""

    path: Path
    """The directory written."""
    to: str
    """``"transformers"`` or ``"conveyor"``."""
    tensors: int
    """How many tensors it holds."""
    nbytes: int
    """Their total size in bytes."""
    files: list[str] = field(default_factory=list)
    """The files written in ``path`` (safetensors files, index, configs; or the checkpoint)."""
    note: str | None = None
    """A sentence about what was not written (no config), or None."""


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    to: str,
    config: str | os.PathLike[str] | None = None,
    *,
    max_shard_size: int | str = "5GB",
    buffer: int = BUFFER,
) -> Conversion:
    """Convert the checkpoint at ``src`` into format ``to`` at ``out``, tensor by tensor.

    ``to="transformers"``: ``src`` is a conveyor checkpoint (written by
    :func:`conveyor.save`, any layout); ``out`` gets safetensors shards of at most
    ``max_shard_size`` and ``model.safetensors.index.json``, as
    :func:`conveyor.save_pretrained` writes them, each tied weight once. With ``config``,
    its ``config.json`` and ``generation_config.json`` are copied too and a transformers
    model's converted tensors (mixture-of-experts experts) are written in the layout its
    own ``save_pretrained`` writes, so ``from_pretrained`` reads the directory; without
    it, a warning says that no config was written.

    ``to="conveyor"``: ``src`` is a transformers checkpoint directory (or one
    ``.safetensors`` file); ``out`` gets a conveyor checkpoint that :func:`conveyor.load`,
    ``Pipeline(weights=)`` and :func:`conveyor.load_model_state` read. With ``config``,
    under the names the transformers model has (experts stacked as it holds them, tied
    weights stored once); without it, under the stored names.

    No more than one tensor (or one group transformers converts together) plus
    ``buffer`` bytes is in memory at a time. ``out`` may be missing, empty, or a
    checkpoint of format ``to`` (replaced; until the new one is whole, the old one stays
    readable).

    Args:
        src: The checkpoint to convert.
        out: The directory to write.
        to: ``"transformers"`` or ``"conveyor"``.
        config: A directory with the model's transformers ``config.json``.
        max_shard_size: The largest safetensors file (``to="transformers"``): bytes, or
            text as transformers reads it (``"5GB"``).
        buffer: The most bytes of small tensors read at once.

    Returns:
        What was written.

    Raises:
        ConfigError: For an unknown ``to``, a bad ``max_shard_size``, or a ``config``
            without a ``config.json``.
        CheckpointError: If ``src`` holds no checkpoint of the other format, ``out`` is a
            file or a non-empty directory that is not a checkpoint of format ``to``, or
            reading or writing fails.
    """
    limit = check(src, out, to, config, max_shard_size)
    source, target = Path(src), Path(out)
    config_dir = Path(config) if config is not None else None
    model = _meta_model(config_dir) if config_dir is not None else None
    if to == "conveyor":
        return _to_conveyor(source, target, model)
    done = _to_transformers(source, target, model, config_dir, limit, buffer)
    if done.note:
        warnings.warn(done.note, stacklevel=2)
    return done


# ------------------------------------------------------------------ paths and the model
def check(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    to: str,
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = "5GB",
) -> int:
    """The checks :func:`convert` makes before it reads or writes anything.

    Returns:
        ``max_shard_size`` in bytes.

    Raises:
        ConfigError: For an unknown ``to``, a bad ``max_shard_size``, or a ``config``
            without a ``config.json``.
        CheckpointError: If ``src`` holds no checkpoint of the other format, or ``out``
            is a file or a non-empty directory that is not a checkpoint of format ``to``.
    """
    if to not in TARGETS:
        raise ConfigError(f"to must be 'transformers' or 'conveyor', got {to!r}")
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config is not None and not (Path(config) / "config.json").is_file():
        raise ConfigError(
            f"--config {config} has no config.json; pass the directory of the model's "
            f"transformers config (what config.save_pretrained writes)"
        )
    _check_source(Path(src), to)
    _check_out(Path(src), Path(out), to)
    return limit


def _is_transformers(path: Path) -> bool:
    """Whether ``path`` is a transformers checkpoint directory or a safetensors file."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / SINGLE).is_file() or (path / INDEX).is_file()


def _check_source(src: Path, to: str) -> None:
    """A CheckpointError unless ``src`` holds a checkpoint of the other format."""
    if not src.exists():
        raise CheckpointError(f"no checkpoint at {src}: the path does not exist; check it")
    if to == "transformers" and not exists(src):
        other = " (a transformers checkpoint: use --to conveyor)" if _is_transformers(src) else ""
        raise CheckpointError(
            f"{src} is not a conveyor checkpoint{other}; pass a directory written by conveyor.save"
        )
    if to == "conveyor" and not _is_transformers(src):
        other = " (a conveyor checkpoint: use --to transformers)" if exists(src) else ""
        raise CheckpointError(
            f"{src} is not a transformers checkpoint{other}; pass a directory with "
            f"{SINGLE} or {INDEX}, or a .safetensors file"
        )


def _check_out(src: Path, out: Path, to: str) -> None:
    """A CheckpointError unless ``out`` is new, empty, or a checkpoint of format ``to``."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"cannot write to {out}: it is a file; pass a directory")
    if out.exists() and out.resolve() == src.resolve():
        raise CheckpointError(f"cannot convert {src} into itself; pass another output directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    ours = (out / LATEST).is_file() if to == "conveyor" else holds_checkpoint(out)
    if not ours:
        kind = "conveyor checkpoint" if to == "conveyor" else "transformers checkpoint"
        raise CheckpointError(
            f"{out} is not empty and holds no {kind}, so it is not overwritten; pass a new or "
            f"empty directory"
        )


def _meta_model(config: Path) -> nn.Module:
    """The transformers model of ``config`` (a directory with config.json), its parameters
    on the meta device: its names, shapes and weight conversions, no memory."""
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(config))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--config {config}: transformers cannot read its config.json ({exc}); pass the "
            f"directory of the model's transformers config"
        ) from None
    classes = [getattr(transformers, a, None) for a in (cfg.architectures or [])]
    auto: Any = transformers.AutoModelForCausalLM
    with empty_weights():
        cls = next((c for c in classes if c is not None), None)
        if cls is not None:
            model: nn.Module = cls(cfg)
            return model
        try:
            model = auto.from_config(cfg)
        except ValueError:  # not a causal LM: the base model
            auto = transformers.AutoModel
            model = auto.from_config(cfg)
        return model


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def _trim() -> None:
    """Give freed memory back to the system. glibc keeps a freed block that sat below
    its heap's top resident, and the small objects each write leaves (DCP's records)
    fill such holes, so the next tensor of the same size takes new memory: without this,
    the process would grow by about each tensor up to glibc's mmap threshold (32 MiB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# ------------------------------------------------------------ conveyor -> transformers
def _to_transformers(
    src: Path, out: Path, model: nn.Module | None, config: Path | None, limit: int, buffer: int
) -> Conversion:
    """Write the conveyor checkpoint ``src`` as safetensors files into ``out`` (and the
    configs of directory ``config``)."""
    _, meta, metadata = read_checkpoint(src)
    stored = {
        k[len("model/") :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model/") and isinstance(md, TensorStorageMetadata)
    }
    # Model order (conveyor.json's keys), tied weights once: under their stored name.
    order = [n for n in meta["keys"] if n in stored]
    order += [n for n in stored if n not in set(order)]
    published = Published(model)
    # copies of a tied weight (each rank of a pipeline may have saved its own)
    copies = published.tied_copies()
    order = [n for n in order if not (n in copies and copies[n] in stored)]
    groups = published.groups(order)
    # What each group becomes, on the meta device: the files' headers come first.
    outputs: list[list[TensorInfo]] = []
    for group in groups:
        fake = {
            n: torch.empty(stored[n].size, dtype=stored[n].properties.dtype, device="meta")
            for n in group
        }
        outputs.append(published.infos(fake))
    infos = [i for group_infos in outputs for i in group_infos]
    if len({i.name for i in infos}) != len(infos):
        raise CheckpointError(f"converting {src} gives two tensors of one name; it is damaged")
    files = pack(((i.name, i.nbytes) for i in infos), limit)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    names = free_names(out, len(files))
    by_name = {i.name: i for i in infos}
    shards = Shards(
        out, [(f, [by_name[n] for n in group]) for f, group in zip(names, files, strict=True)]
    )
    sizes = (
        (g, sum(math.prod(stored[n].size) * stored[n].properties.dtype.itemsize for n in g))
        for g in groups
    )
    reader = ConveyorCheckpoint(src)
    target = out
    try:
        for batch in runs(sizes, buffer):
            values = reader.read([n for g in batch for n in g])
            for g in batch:
                for name, value in published.revert({n: values.pop(n) for n in g}).items():
                    target = out / shards.file_of[name]
                    shards.write(name, value)
            del values
            _trim()
        target = out / INDEX
        configs = read_configs(config) if config is not None else {}
        totals = {
            "total_parameters": sum(math.prod(i.shape) for i in infos),
            "total_size": sum(i.nbytes for i in infos),
        }
        commit(out, shards.file_of, totals, configs)
    except BaseException as exc:
        shards.abort()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        raise CheckpointError(
            f"converting {src}: writing {target} failed: {type(exc).__name__}: {exc}; the "
            f"previous checkpoint there (if any) is kept"
        ) from None
    written = [*configs, *names, INDEX]
    notes = [] if config is not None else [NO_CONFIG.format(out=out)]
    objects = [
        k[len("model/") :]
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model/") and not isinstance(md, TensorStorageMetadata)
    ]
    if objects:
        notes.append(
            f"{len(objects)} entries of {src} that are not tensors (a module's extra state, "
            f"e.g. {objects[0]}) were left out: safetensors files hold tensors only"
        )
    note = "; ".join(notes) or None
    nbytes = sum(i.nbytes for i in infos)
    return Conversion(out, "transformers", len(infos), nbytes, written, note)


# ------------------------------------------------------------ transformers -> conveyor
class _MetaReads:
    """``files``, read as meta tensors of the stored dtype and shape: a conversion run on
    them gives the converted tensors' shapes and dtypes without reading a byte."""

    def __init__(self, files: Safetensors) -> None:
        self.where = files.where
        self._files = files

    def names(self) -> list[str]:
        return self._files.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.shape(name)

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        f = self._files
        return {n: torch.empty(f.shape(n), dtype=f.dtype(n), device="meta") for n in names}

    def alias(self, name: str) -> str:
        return name


class _LazyPlanner(DefaultSavePlanner):
    """DCP's planner over a state dict of meta tensors: each tensor is read from
    ``read(name)`` only when DCP writes it.

    DCP's file writer keeps every tensor of a file referenced until the file is closed
    (it collects them for its safetensors format, whatever the format), and a rank writes
    one file: the whole checkpoint would stay in memory. With its serial loader (no copy
    ahead: ``per_thread_copy_ahead=0``) the next tensor is resolved only once the previous
    one is written, so resolving one frees the memory of the one before.
    """

    def __init__(self, read: Any) -> None:
        super().__init__()
        self._read = read
        self._last: Tensor | None = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if not fqn.startswith("model/"):
            return super().resolve_data(write_item)
        self.release()
        value: Tensor = self._read(fqn[len("model/") :])
        if value.untyped_storage().nbytes() != value.nbytes:
            value = value.clone()  # its own memory, all of it, to be freed after
        self._last = value
        return value

    def release(self) -> None:
        """Free the memory of the tensor resolved last (DCP has written it)."""
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
            self._last = None
            _trim()


def _to_conveyor(src: Path, out: Path, model: nn.Module | None) -> Conversion:
    """Write the transformers checkpoint ``src`` as a conveyor checkpoint into ``out``."""
    files = Safetensors(src)
    source: Any = files
    plan: Any = _MetaReads(files)
    if model is not None:
        mapping = conversion_mapping(model)
        if mapping:
            source = Converted(files, model, mapping)
            plan = Converted(plan, model, mapping)
    names = list(source.names())
    planned = plan.read(names)  # meta tensors: each one's dtype and shape
    aliases: dict[str, str] = {}
    keys = names
    if model is not None:
        held = set(names)
        for tied in (t for t in Names(model).aliases.values() if len(t) > 1):
            first = next((n for n in tied if n in held), None)
            aliases.update({n: first for n in tied if first is not None and n not in held})
        own = list(model.state_dict(keep_vars=True))
        keys = [n for n in own if n in held or n in aliases]
        keys += [n for n in names if n not in set(keys)]
    state = {f"model/{n}": planned[n] for n in names}
    kind = None if model is None else type(model).__name__
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": None,
        "saved_by": {"converted": "transformers", "model": kind},
        "keys": keys,
        "aliases": aliases,
        "optimizer": None,
    }

    def read(name: str) -> Tensor:
        value: Tensor = source.read([name])[name]
        return value.contiguous()

    planner = _LazyPlanner(read)

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    ckpt_name = layout.new_name(None)
    try:
        with quiet(), dcp_errors(f"writing a checkpoint to {out}", "the previous one is kept"):
            dcp_save(
                state,
                storage_writer=FileSystemWriter(
                    out / f"{ckpt_name}.tmp", thread_count=1, per_thread_copy_ahead=0
                ),
                planner=planner,
                no_dist=True,
            )
        planner.release()
        try:
            layout.commit(out, ckpt_name, meta)
        except OSError as exc:
            raise CheckpointError(
                f"converting {src}: committing checkpoint {out / ckpt_name} failed: "
                f"{type(exc).__name__}: {exc}; the previous checkpoint there (if any) is kept"
            ) from None
    except BaseException:
        shutil.rmtree(out / f"{ckpt_name}.tmp", ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    finally:
        files.close()
    nbytes = sum(v.numel() * v.element_size() for v in planned.values())
    return Conversion(out, "conveyor", len(names), nbytes, [LATEST, ckpt_name])
