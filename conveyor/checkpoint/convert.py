"""One checkpoint format into the other, tensor by tensor: a conveyor checkpoint
(:func:`conveyor.save`, any layout) into a transformers directory (safetensors files, the
index, the config), and back.

Neither direction holds more than a bounded buffer of small tensors, or one large tensor
(with its group, for the tensors transformers converts together, such as a layer's
experts), at a time:

- ``to="transformers"``: DCP reads the tensors of a batch whole (a batch: tensors up to
  :data:`BUFFER` bytes, or one larger tensor), and the streaming writer of
  :mod:`conveyor.checkpoint.safetensors_file` writes each at its place in a file whose
  header was written first. Not torch's ``HuggingFaceStorageWriter``: it hands every
  tensor of a file to safetensors' ``save`` at once (a whole shard, up to
  ``max_shard_size``, in memory, and its bytes once more).
- ``to="conveyor"``: DCP saves a state dict of meta tensors; its planner reads each tensor
  from the safetensors files only when DCP writes it. The files are read with plain file
  reads, not memory maps (nor ``HuggingFaceStorageReader``, which loads into a state dict
  that would have to be whole): a mapped file's pages count as the process's memory while
  it stays mapped, so reading a whole checkpoint through maps would grow the process by
  its size.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import io
import json
import math
import os
import secrets
import shutil
import struct
import warnings
from collections.abc import Iterable, Iterator
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

from conveyor.checkpoint.layout import commit, new_name
from conveyor.checkpoint.safetensors_file import (
    INDEX,
    SINGLE,
    FileWriter,
    TensorInfo,
    dtype_code,
    pack,
    parse_size,
    shard_names,
    write_index,
)
from conveyor.errors import CheckpointError, ConfigError
from conveyor.storage import FORMAT, LATEST, VERSION, dcp_errors, exists, quiet, read_checkpoint

__all__ = ["BUFFER", "TARGETS", "Conversion", "SafetensorsFiles", "check", "convert"]

TARGETS = ("transformers", "conveyor")
"""The formats :func:`convert` writes."""
BUFFER = 64 * 2**20
"""The most bytes of tensors read at once, unless one tensor alone is larger."""
CONFIGS = ("config.json", "generation_config.json")
"""The files ``config=`` copies into a transformers directory (when there)."""
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
    :func:`conveyor.save`, any layout); ``out`` gets safetensors files (``model.safetensors``,
    or shards of at most ``max_shard_size`` with ``model.safetensors.index.json``, as
    transformers' ``save_pretrained`` writes them), each tied weight once. With ``config``,
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
    ours = (out / LATEST).is_file() if to == "conveyor" else _is_transformers(out)
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

    from conveyor.weights.empty import empty_weights

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


def _batches(items: Iterable[tuple[Any, int]], buffer: int) -> Iterator[list[Any]]:
    """Consecutive items of at most ``buffer`` bytes together (a larger one alone)."""
    batch: list[Any] = []
    used = 0
    for item, size in items:
        if batch and used + size > buffer:
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += size
    if batch:
        yield batch


# ------------------------------------------------------------ conveyor -> transformers
def _reverse_groups(model: Any, names: list[str]) -> list[list[str]]:
    """``names`` grouped as transformers' ``revert_weight_conversion`` converts them
    together (a layer's stacked experts: one group), in order of their first name."""
    if model is None:
        return [[n] for n in names]
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            apply_converters,
        )
    except ImportError:  # a transformers without conversions (< 5)
        return [[n] for n in names]
    # As revert_weight_conversion picks them for a model not loaded by from_pretrained.
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c
            for c in get_model_conversion_mapping(model, add_legacy=False)
            if not isinstance(c, PrefixChange)
        ]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    groups: dict[tuple[bool, str], list[str]] = {}
    for n in names:
        renamed, pattern = apply_converters(n, converters)
        key = (True, renamed) if pattern is not None else (False, n)
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def _tied_copies(model: nn.Module) -> dict[str, str]:
    """Each other name of a parameter the model ties -> its first name (the one
    ``named_parameters`` gives, and the one transformers' ``save_pretrained`` keeps)."""
    first = {id(p): n for n, p in model.named_parameters()}
    return {
        n: first[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if first[id(p)] != n
    }


def _revert(model: Any, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """One group's tensors under the names and in the layout transformers saves them."""
    if model is None:
        return values
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversions (< 5): names as held
        return values

    out: dict[str, Tensor] = revert_weight_conversion(model, dict(values))
    return out


def _to_transformers(
    src: Path, out: Path, model: nn.Module | None, config: Path | None, limit: int, buffer: int
) -> Conversion:
    """Write the conveyor checkpoint ``src`` as safetensors files into ``out`` (and the
    configs of directory ``config``)."""
    from conveyor.weights.sources import ConveyorCheckpoint

    _, meta, metadata = read_checkpoint(src)
    stored = {
        k[len("model/") :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model/") and isinstance(md, TensorStorageMetadata)
    }
    # Model order (conveyor.json's keys), tied weights once: under their stored name.
    order = [n for n in meta["keys"] if n in stored]
    order += [n for n in stored if n not in set(order)]
    if model is not None:  # copies of a tied weight (each rank of a pipeline saved its own)
        copies = _tied_copies(model)
        order = [n for n in order if not (n in copies and copies[n] in stored)]
    groups = _reverse_groups(model, order)
    # What each group becomes, on the meta device: the files' headers come first.
    outputs: list[list[TensorInfo]] = []
    for group in groups:
        fake = {
            n: torch.empty(stored[n].size, dtype=stored[n].properties.dtype, device="meta")
            for n in group
        }
        outputs.append([TensorInfo.of(n, v) for n, v in _revert(model, fake).items()])
    infos = [i for group_infos in outputs for i in group_infos]
    if len({i.name for i in infos}) != len(infos):
        raise CheckpointError(f"converting {src} gives two tensors of one name; it is damaged")
    files = pack(((i.name, i.nbytes) for i in infos), limit)
    file_names = [SINGLE] if len(files) == 1 else shard_names(len(files))
    if out.is_dir() and set(file_names) & {p.name for p in out.iterdir()}:
        # Replacing a checkpoint: new names, so that the old files stay whole until the end.
        file_names = [SINGLE] if len(files) == 1 else shard_names(len(files), secrets.token_hex(4))
    file_of = {n: f for f, names in zip(file_names, files, strict=True) for n in names}
    by_name = {i.name: i for i in infos}

    sizes = (
        (g, sum(math.prod(stored[n].size) * stored[n].properties.dtype.itemsize for n in g))
        for g in groups
    )
    doing = f"writing into {out}"
    writers: dict[str, FileWriter] = {}
    with _staging(out) as stage:
        try:
            for f, names in zip(file_names, files, strict=True):
                doing = f"writing {f} into {out}"
                writers[f] = FileWriter(stage / f, [by_name[n] for n in names])
            reader = ConveyorCheckpoint(src)
            for batch in _batches(sizes, buffer):
                values = reader.read([n for g in batch for n in g])
                for g in batch:
                    converted = _revert(model, {n: values.pop(n) for n in g})
                    for name, value in converted.items():
                        doing = f"writing {file_of[name]} into {out}"
                        writers[file_of[name]].write(name, value)
                    del converted
                del values
                _trim()
            for f, w in writers.items():
                doing = f"writing {f} into {out}"
                w.close()
            doing = f"writing {INDEX} into {out}"
            if len(files) > 1:
                total = sum(i.nbytes for i in infos)
                params = sum(math.prod(i.shape) for i in infos)
                write_index(stage, file_of, {"total_parameters": params, "total_size": total})
            doing = f"copying the configs of {config} into {out}"
            configs = _copy_configs(config, stage) if config is not None else []
            written = [*configs, *file_names, *([INDEX] if len(files) > 1 else [])]
            doing = f"moving the new files into {out}"
            _publish(stage, out, written, replaced=_weight_files(out))
        except OSError as exc:
            raise CheckpointError(
                f"converting {src}: {doing} failed: {type(exc).__name__}: {exc}; the "
                f"previous checkpoint there (if any) is kept"
            ) from None
        finally:
            for w in writers.values():
                with contextlib.suppress(OSError):
                    w.abort()  # a closed one is already renamed: nothing to remove
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


def _weight_files(out: Path) -> list[str]:
    """The files of the transformers checkpoint in ``out`` now (to remove once replaced)."""
    if not out.is_dir():
        return []
    names = [SINGLE] if (out / SINGLE).is_file() else []
    index = out / INDEX
    if index.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            names += list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        names.append(INDEX)
    return names


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` to write into; removed afterwards (its files
    have been moved into ``out`` by then, unless something failed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.convert-{secrets.token_hex(4)}.tmp"
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, out: Path, written: list[str], replaced: list[str]) -> None:
    """Move the files ``written`` from ``stage`` into ``out``: all at once (one rename)
    into a new or empty ``out``; else the safetensors files first, then what makes them
    current (the index, or ``model.safetensors``), then the replaced files are removed."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()
        os.rename(stage, out)
        return
    last = [n for n in (INDEX, SINGLE) if n in written][:1]
    moved: list[str] = []
    try:
        for name in [*(n for n in written if n not in last), *last]:
            os.replace(stage / name, out / name)
            moved.append(name)
    except BaseException:
        # The old checkpoint is still the current one: drop the new files beside it.
        for name in moved:
            if name.endswith(".safetensors") and name not in replaced:
                (out / name).unlink(missing_ok=True)
        raise
    for name in replaced:
        if name not in written:
            (out / name).unlink(missing_ok=True)


def _copy_configs(config: Path, stage: Path) -> list[str]:
    """Copy ``config.json`` (and ``generation_config.json``) into ``stage``; their names."""
    copied = [name for name in CONFIGS if (config / name).is_file()]
    for name in copied:
        shutil.copyfile(config / name, stage / name)
    return copied


# ------------------------------------------------------------ transformers -> conveyor
_DTYPES = {
    dtype_code(d): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2)
}  # fmt: skip


class SafetensorsFiles:
    """A transformers checkpoint's safetensors files, each tensor read with plain file
    reads into its own memory (see the module's docstring for why not a memory map).

    Args:
        path: A directory with ``model.safetensors`` or shards and the index, or one
            ``.safetensors`` file.
    """

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        if path.is_file():
            files = [path]
        elif (path / SINGLE).is_file():
            files = [path / SINGLE]
        else:
            weight_map: dict[str, str] = json.loads((path / INDEX).read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]  # shard order
        # name -> (file, absolute offset, dtype, shape)
        self._at: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        for file in files:
            try:
                with open(file, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header: dict[str, Any] = json.loads(f.read(length))
            except (OSError, ValueError, struct.error) as exc:
                raise CheckpointError(
                    f"cannot read the safetensors header of {file}: {exc}; is it damaged?"
                ) from None
            entries = [(n, e) for n, e in header.items() if n != "__metadata__"]
            for name, entry in sorted(entries, key=lambda e: int(e[1]["data_offsets"][0])):
                if entry["dtype"] not in _DTYPES:
                    raise CheckpointError(
                        f"{file} stores {name} as {entry['dtype']}, which conveyor cannot "
                        f"read; convert it to a torch dtype first"
                    )
                start = 8 + length + int(entry["data_offsets"][0])
                self._at[name] = (file, start, _DTYPES[entry["dtype"]], tuple(entry["shape"]))
        self._open: dict[Path, io.BufferedReader] = {}

    def names(self) -> list[str]:
        """The stored tensors' names, in stored order."""
        return list(self._at)

    def shape(self, name: str) -> tuple[int, ...]:
        """A stored tensor's shape."""
        return self._at[name][3]

    def dtype(self, name: str) -> torch.dtype:
        """A stored tensor's dtype."""
        return self._at[name][2]

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The stored tensors ``names``, each in memory of its own."""
        out = {}
        for name in names:
            file, start, dtype, shape = self._at[name]
            value = torch.empty(shape, dtype=dtype)
            # The tensor's memory as a writable buffer, through ctypes rather than numpy:
            # numpy would pin the storage's size, and _LazyPlanner frees it by resizing.
            view = memoryview((ctypes.c_char * value.nbytes).from_address(value.data_ptr())).cast(
                "B"
            )
            if file not in self._open:
                self._open[file] = open(file, "rb")  # noqa: SIM115 (closed by close())
            f = self._open[file]
            f.seek(start)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{file} ends inside {name}; it is damaged")
                got += n
            out[name] = value
        return out

    def alias(self, name: str) -> str:
        """The stored name of ``name`` (itself: a file stores each name it lists)."""
        return name

    def close(self) -> None:
        """Close the files read so far."""
        for f in self._open.values():
            f.close()
        self._open.clear()


class _MetaReads:
    """``files``, read as meta tensors of the stored dtype and shape: a conversion run on
    them gives the converted tensors' shapes and dtypes without reading a byte."""

    def __init__(self, files: SafetensorsFiles) -> None:
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


def _ties(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names, in model order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _to_conveyor(src: Path, out: Path, model: nn.Module | None) -> Conversion:
    """Write the transformers checkpoint ``src`` as a conveyor checkpoint into ``out``."""
    files = SafetensorsFiles(src)
    source: Any = files
    plan: Any = _MetaReads(files)
    if model is not None:
        from conveyor.weights.converted import Converted

        mapping = _load_mapping(model)
        if mapping:
            source = Converted(files, model, mapping)
            plan = Converted(plan, model, mapping)
    names = list(source.names())
    planned = plan.read(names)  # meta tensors: each one's dtype and shape
    aliases: dict[str, str] = {}
    keys = names
    if model is not None:
        held = set(names)
        for tied in _ties(model):
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
    ckpt_name = new_name(None)
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
            commit(out, ckpt_name, meta)
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


def _load_mapping(model: nn.Module) -> list[Any]:
    """The weight conversions ``from_pretrained`` applies to ``model`` ([] for none)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    mapping: list[Any] = get_model_conversion_mapping(model)
    return mapping
