"""Safetensors files read and written one tensor at a time, and the index of a sharded
directory.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range, and ``__metadata__``), then the tensors' bytes. The header is
known before any tensor is: :class:`FileWriter` writes it first and then each tensor at
its offset, so a writer never holds more than the tensor it is writing (the safetensors
library's own writers take every tensor of a file at once). :class:`FileReader` reads a
tensor with plain file reads into memory of its own: not through a memory map (the
safetensors library's way), whose pages count as the process's memory while the file
stays mapped, so that reading a whole checkpoint that way grows a process by its size.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from conveyor.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``F32``, ``BF16``, ...).

    Raises:
        ValueError: for a dtype safetensors cannot store.
    """
    if dtype not in _CODES:
        raise ValueError(f"safetensors cannot store {dtype}")
    return _CODES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says about one tensor."""

    name: str
    dtype: str  # the safetensors code
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in the file."""
        return math.prod(self.shape) * self.itemsize

    @staticmethod
    def of(name: str, value: Tensor) -> TensorInfo:
        """The entry of ``value`` (any device, meta included) under ``name``."""
        return TensorInfo(name, dtype_code(value.dtype), tuple(value.shape), value.element_size())


def _header(infos: Sequence[TensorInfo]) -> tuple[bytes, dict[str, int]]:
    """The encoded header (length prefix included, padded to 8 bytes) and each tensor's
    absolute offset in the file, tensors in the given order."""
    table: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at, starts = 0, {}
    for info in infos:
        table[info.name] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": [at, at + info.nbytes],
        }
        starts[info.name] = at
        at += info.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {n: len(head) + s for n, s in starts.items()}


class FileWriter:
    """One safetensors file, its header written first; :meth:`write` each tensor it lists
    (in any order), then :meth:`close`. It is written under ``path + ".tmp"`` and renamed
    to ``path`` by :meth:`close` once complete, so a file under its final name is whole.

    Args:
        path: The file to write.
        infos: Every tensor of the file, in the order they are laid out.
    """

    def __init__(self, path: str | os.PathLike[str], infos: Sequence[TensorInfo]) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".tmp")
        self._infos = {i.name: i for i in infos}
        head, self._offsets = _header(infos)
        self._left = set(self._infos)
        self._file = open(self.partial, "wb")  # noqa: SIM115 (closed by close/abort)
        self._file.write(head)

    def write(self, name: str, value: Tensor) -> None:
        """Write the tensor ``name`` (as its header says: same dtype and shape)."""
        info = self._infos[name]
        if TensorInfo.of(name, value) != info or name not in self._left:
            raise ValueError(
                f"{name}: {value.dtype} {tuple(value.shape)} does not match the header's "
                f"{info.dtype} {info.shape}, or was written already"
            )
        self._left.discard(name)
        if info.nbytes == 0:
            return
        flat = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._offsets[name])
        self._file.write(flat.numpy().data)

    def close(self) -> None:
        """Finish the file: every tensor written, on disk (fsync), under its final name."""
        if self._left:
            raise ValueError(f"{self.path}: tensors never written: {sorted(self._left)[:3]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        """Stop and remove the unfinished file."""
        self._file.close()
        self.partial.unlink(missing_ok=True)


class FileReader:
    """One safetensors file: its header read at once, each tensor on demand.

    Args:
        path: The file.

    Raises:
        CheckpointError: an unreadable header, or a dtype torch has no name for.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header: dict[str, Any] = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(
                f"cannot read the safetensors header of {self.path}: {exc}; is it damaged?"
            ) from None
        entries = sorted(
            ((n, e) for n, e in header.items() if n != "__metadata__"),
            key=lambda item: int(item[1]["data_offsets"][0]),
        )
        # name -> (absolute offset, dtype, shape), in stored order
        self.entries: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        for name, entry in entries:
            if entry["dtype"] not in _DTYPES:
                raise CheckpointError(
                    f"{self.path} stores {name} as {entry['dtype']}, which conveyor cannot "
                    f"read; convert it to a torch dtype first"
                )
            start = 8 + length + int(entry["data_offsets"][0])
            self.entries[name] = (start, _DTYPES[entry["dtype"]], tuple(entry["shape"]))
        self._file: io.BufferedReader | None = None

    def read(self, name: str) -> Tensor:
        """The stored tensor ``name``, in memory of its own (on the CPU)."""
        start, dtype, shape = self.entries[name]
        value = torch.empty(shape, dtype=dtype)
        # The tensor's memory as a writable buffer through ctypes, not numpy: numpy would
        # pin the storage's size, which a reader may free by resizing it.
        raw = (ctypes.c_char * value.nbytes).from_address(value.data_ptr())
        view = memoryview(raw).cast("B")
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        self._file.seek(start)
        got = 0
        while got < len(view):
            n = self._file.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{self.path} ends inside {name}; it is damaged")
            got += n
        return value

    def close(self) -> None:
        """Close the file (it is opened again by the next read)."""
        if self._file is not None:
            self._file.close()
            self._file = None


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
    """Write ``model.safetensors.index.json`` into directory ``path`` atomically (a
    temporary file, fsynced, then renamed over the old one)."""
    target = Path(path) / INDEX
    body = {"metadata": dict(metadata), "weight_map": dict(sorted(weight_map.items()))}
    replace_file(target, json.dumps(body, indent=2) + "\n")


def replace_file(target: Path, text: str) -> None:
    """Write ``text`` as file ``target`` atomically: into a temporary file, on disk
    (fsync), then renamed over ``target``; nothing is left behind if that fails."""
    partial = target.with_name(target.name + ".tmp")
    try:
        with open(partial, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


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
