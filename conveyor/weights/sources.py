"""Where ``weights=`` values come from: a conveyor checkpoint or a transformers checkpoint
directory, read one tensor (or the part of one a rank holds) at a time, so that a rank
reads only what it holds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from conveyor.errors import CheckpointError
from conveyor.weights.safetensors_file import INDEX, SINGLE, File, Part


class Source(Protocol):
    """Stored tensors, by name."""

    where: str  # what messages call it

    def names(self) -> list[str]:
        """The stored tensors' names, in stored order."""

    def shape(self, name: str) -> tuple[int, ...]:
        """A stored tensor's shape, without reading it."""

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The stored tensors ``names`` (on the CPU, in their stored dtype)."""

    def read_part(self, name: str, part: Part) -> Tensor:
        """The box ``part`` of the stored tensor ``name`` (a source that cannot read less
        reads it whole and cuts it)."""

    def alias(self, name: str) -> str:
        """The stored name of the model's tensor ``name`` (a tied weight is stored once)."""


class Safetensors:
    """A transformers checkpoint: ``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``, or one ``.safetensors`` file; each tensor, or the box
    of it that is asked for, is read on its own into memory of its own
    (:class:`~conveyor.weights.safetensors_file.File`: never left backed by a file that
    may be rewritten while training)."""

    # Not torch's HuggingFaceStorageReader: that is a DCP reader, which loads a whole
    # state dict planned up front, while a rank here asks for tensors one group at a time
    # (transformers' conversions stack several stored tensors into one), by name.

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        if path.is_file():
            files = [path]
        elif (path / INDEX).is_file() and not (path / SINGLE).is_file():
            weight_map: dict[str, str] = json.loads((path / INDEX).read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]  # shard order
        else:
            files = [path / SINGLE]
        self._file_of = {n: f for f in map(File, files) for n in f.entries}

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of[name].entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """A stored tensor's dtype."""
        return self._file_of[name].entries[name].dtype

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        return {n: self._file_of[n].read(n) for n in names}

    def read_part(self, name: str, part: Part) -> Tensor:
        return self._file_of[name].read(name, part)

    def alias(self, name: str) -> str:
        return name


class ConveyorCheckpoint:
    """A checkpoint :func:`conveyor.save` wrote, of any layout; DCP reads each requested
    tensor whole from the shards that hold it."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from conveyor.storage import read_checkpoint, without_weights

        self._dir, meta, metadata = read_checkpoint(path)
        if meta.get("weights") is False:
            raise CheckpointError(without_weights(self._dir))
        self.where = str(self._dir)
        self._aliases: dict[str, str] = meta["aliases"]
        self._stored = {
            k[len("model/") :]: md
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith("model/") and isinstance(md, TensorStorageMetadata)
        }

    def names(self) -> list[str]:
        return list(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._stored[name].size)

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from conveyor.storage import dcp_errors, quiet

        state: dict[str, Any] = {}
        for n in names:
            md = self._stored[n]
            state[f"model/{n}"] = torch.empty(md.size, dtype=md.properties.dtype)
        with quiet(), dcp_errors(f"reading weights from {self.where}", "is it damaged?"):
            dcp_load(state, storage_reader=FileSystemReader(self._dir), no_dist=True)
        return {k[len("model/") :]: v for k, v in state.items()}

    def read_part(self, name: str, part: Part) -> Tensor:
        return self.read([name])[name][part].clone()  # DCP reads the tensor whole

    def alias(self, name: str) -> str:
        return self._aliases.get(name, name)


def open_source(path: str | os.PathLike[str]) -> Source:
    """The checkpoint at ``path``: a conveyor checkpoint directory, a transformers
    checkpoint directory, or one ``.safetensors`` file.

    Raises:
        CheckpointError: nothing readable is there, in one sentence.
    """
    from conveyor.storage import exists

    root = Path(path)
    if root.is_file() and root.suffix == ".safetensors":
        return Safetensors(root)
    if root.is_dir() and ((root / SINGLE).is_file() or (root / INDEX).is_file()):
        return Safetensors(root)
    if exists(root):
        return ConveyorCheckpoint(root)
    raise CheckpointError(
        f"weights={str(path)!r} is neither a conveyor checkpoint (conveyor.save) nor a "
        f"transformers checkpoint directory ({SINGLE} or {INDEX}); pass one of them, or "
        f"weights=None to initialize the model"
    )
