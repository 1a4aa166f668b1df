"""Safetensors files through the ``safetensors`` package, and the index of a sharded
directory.

Reads (:class:`File`): ``safe_open`` gives a file's tensors from its header; a tensor, or
the box of it a rank holds (``get_slice``: an FSDP or tensor-parallel shard, vocabulary
rows, a range of experts), is copied into memory of its own a run of rows at a time, each
run through a handle of its own. The package maps the file, and the pages of a mapping
count as the process's memory while it is open: so a read adds no more than a run
(:data:`CHUNK`) to the tensor it makes, and no value stays backed by a file that a later
save replaces.

Writes (:func:`write_file`): ``safetensors.torch.save_file`` writes a file from every one
of its tensors at once, so a writer holds the tensors of one file (at most
``max_shard_size``, or one larger tensor) while it writes it; each file is committed
atomically (:func:`conveyor.storage.write_atomically`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from conveyor.errors import CheckpointError
from conveyor.storage import write_atomically, write_text

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
METADATA = {"format": "pt"}
"""The header metadata transformers' ``save_pretrained`` writes (and its loader checks)."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""The stored dtypes conveyor reads (the safetensors code -> torch's dtype)."""

Part = tuple[slice, ...]
"""A box of a tensor: one ``slice(lo, hi)`` per dimension."""
CHUNK = 16 * 2**20
"""The most bytes of a file a read maps at once."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a file stores it: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The tensor's size in the file."""
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(name: str, value: Tensor) -> TensorInfo:
        """The entry of ``value`` (any device, meta included) under ``name``."""
        return TensorInfo(name, value.dtype, tuple(value.shape))


class File:
    """One safetensors file: its header read at once, each tensor (or part) on demand.

    Args:
        path: The file.

    Raises:
        CheckpointError: an unreadable or incomplete file, or a dtype conveyor cannot read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries: dict[str, TensorInfo] = {}  # in stored order
        try:
            with safe_open(self.path, framework="pt") as f:
                for name in f.offset_keys():
                    stored = f.get_slice(name)
                    code = stored.get_dtype()
                    if code not in _DTYPES:
                        raise CheckpointError(
                            f"{self.path} stores {name} as {code}, which conveyor cannot "
                            f"read; convert it to a torch dtype first"
                        )
                    shape = tuple(stored.get_shape())
                    self.entries[name] = TensorInfo(name, _DTYPES[code], shape)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(
                f"cannot read the safetensors header of {self.path}: {exc}; is it damaged?"
            ) from None

    def read(self, name: str, part: Part | None = None) -> Tensor:
        """The stored tensor ``name`` (or its box ``part``), in memory of its own on the
        CPU: copied in runs of rows of at most :data:`CHUNK` bytes, each through a handle
        of its own, so that no more than a run of the file is ever mapped."""
        info = self.entries[name]
        box = part if part is not None else tuple(slice(0, n) for n in info.shape)
        out = torch.empty(tuple(s.stop - s.start for s in box), dtype=info.dtype)
        if out.numel() == 0:
            return out
        step = max(1, CHUNK // out[0].nbytes) if out.dim() else 1
        try:
            for lo in range(0, len(out) if out.dim() else 1, step):
                with safe_open(self.path, framework="pt") as f:
                    if not out.dim():
                        out.copy_(f.get_tensor(name))
                        continue
                    hi = min(len(out), lo + step)
                    index = (slice(box[0].start + lo, box[0].start + hi), *box[1:])
                    out[lo:hi].copy_(f.get_slice(name)[index])
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {name} from {self.path}: {exc}") from None
        return out


def write_file(path: str | os.PathLike[str], tensors: Mapping[str, Tensor]) -> None:
    """Write ``tensors`` as the safetensors file ``path``, atomically: under a temporary
    name, on disk, then renamed (:func:`conveyor.storage.write_atomically`).

    Raises:
        OSError: writing failed (``path`` is as it was).
    """

    def save(partial: Path) -> None:
        try:
            save_file({n: _alone(v) for n, v in tensors.items()}, partial, metadata=METADATA)
        except SafetensorError as exc:  # the package's I/O errors, as every other write's
            raise OSError(f"{exc}") from None
        # The package writes through a private temporary file (mode 0600): the mode a
        # file created here would have, so that others who may read the directory can.
        os.chmod(partial, 0o666 & ~_umask())

    write_atomically(path, save)


def _alone(value: Tensor) -> Tensor:
    """``value`` contiguous and in memory of its own (a copy of a view of a larger tensor,
    such as one expert of a stacked expert tensor): the package writes only those."""
    value = value.detach().contiguous()
    if value.untyped_storage().nbytes() != value.nbytes:
        value = value.clone()
    return value


@functools.cache
def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets one to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def runs(items: Iterable[tuple[Any, int]], limit: int) -> Iterator[list[Any]]:
    """Consecutive items (each with its size in bytes) in runs of at most ``limit`` bytes
    (an item larger than ``limit`` alone): files of a sharded checkpoint, batches of reads."""
    run: list[Any] = []
    used = 0
    for item, size in items:
        if run and used + size > limit:
            yield run
            run, used = [], 0
        run.append(item)
        used += size
    if run:
        yield run


def shard_names(count: int, tag: str = "") -> list[str]:
    """The files of a checkpoint in ``count`` shards, named as transformers names them
    (``model-00001-of-00004.safetensors``); a ``tag`` goes after ``model-``."""
    stem = f"model-{tag}-" if tag else "model-"
    return [f"{stem}{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def pack(sizes: Iterable[tuple[str, int]], limit: int) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most ``limit`` bytes each (a larger
    tensor alone in its file), as transformers shards them."""
    return list(runs(sizes, limit))


def write_index(
    path: str | os.PathLike[str], weight_map: Mapping[str, str], metadata: Mapping[str, Any]
) -> None:
    """Write ``model.safetensors.index.json`` into directory ``path`` atomically."""
    body = {"metadata": dict(metadata), "weight_map": dict(sorted(weight_map.items()))}
    write_text(Path(path) / INDEX, json.dumps(body, indent=2) + "\n")


def read_weight_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """The tensor -> file map of the index in directory ``path`` ({} without one)."""
    index = Path(path) / INDEX
    if not index.is_file():
        return {}
    weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
    return weight_map


def parse_size(size: int | str) -> int:
    """Bytes from ``max_shard_size``: an int, or text as transformers reads it
    (``"5GB"`` = 5 * 10**9, ``"5GiB"`` = 5 * 2**30, also ``KB``/``MB``/``KiB``/``MiB``).

    Raises:
        ValueError: for anything else, or a size <= 0.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
                 "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}  # fmt: skip
        unit = next((u for u in units if text.endswith(u)), "")
        try:
            number = float(text[: len(text) - len(unit)]) if unit else float(text)
        except ValueError:
            number = -1.0
        value = int(number * units.get(unit, 1))
    else:
        value = -1
    if value <= 0:
        raise ValueError(
            f"max_shard_size must be a number of bytes > 0 or text such as '5GB', got {size!r}"
        )
    return value
