"""A transformers checkpoint directory, written in place without ever reading as half
written: what marks one, new shards beside the current ones, and the commit.

The new shards never take the name of a file the directory holds, and each is written
under a temporary name and renamed once whole (:class:`Shards`, through
:func:`conveyor.storage.commit`). :func:`commit` then writes the configs, replaces the
index (the moment the directory starts reading as the new checkpoint) and removes what
only the previous checkpoint used. Until then the directory reads as the previous
checkpoint; files of other kinds (a tokenizer, a trainer's runs) are left as they are.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from conveyor.checkpoint.published import CONFIGS
from conveyor.storage import write_text
from conveyor.weights.safetensors_file import (
    INDEX,
    SINGLE,
    TensorInfo,
    read_weight_map,
    shard_names,
    write_file,
    write_index,
)

MARKS = (INDEX, SINGLE, *CONFIGS, "pytorch_model.bin", "pytorch_model.bin.index.json")
"""Files that make a directory a transformers checkpoint (or a trainer's output)."""
SHARD = re.compile(r"model-(?:[0-9a-f]{8}-)?\d{5}-of-\d{5}\.safetensors(?:\.tmp)?")
"""The names of shards this module writes (and of their partial files)."""


def holds_checkpoint(path: Path) -> bool:
    """Whether directory ``path`` holds a transformers checkpoint (weights or configs)."""
    return path.is_dir() and any((path / m).exists() for m in MARKS)


def free_names(root: Path, count: int) -> list[str]:
    """Names for ``count`` new shards in ``root``: transformers' own
    (``model-00001-of-00004.safetensors``), tagged when one of them is taken."""
    names = shard_names(count)
    if any((root / n).exists() for n in names):
        return shard_names(count, secrets.token_hex(4))
    return names


class Shards:
    """New shards of a checkpoint in ``root``, given one tensor at a time: a file is
    written (:func:`~conveyor.weights.safetensors_file.write_file`) once its last tensor
    has come, so only the tensors of the file being filled are held here (on the CPU).

    Args:
        root: The directory.
        files: Each file's name and its tensors in order.
    """

    def __init__(self, root: Path, files: Sequence[tuple[str, Sequence[TensorInfo]]]) -> None:
        self.root = root
        self._infos = {i.name: i for _, infos in files for i in infos}
        self.file_of = {i.name: name for name, infos in files for i in infos}
        self._left = {name: len(infos) for name, infos in files}
        self._filling: dict[str, dict[str, Tensor]] = {}
        self.done: list[str] = []

    def write(self, name: str, value: Tensor) -> None:
        """Give tensor ``name`` (as the file's plan says: same dtype and shape); its file is
        written when it is the last.

        Raises:
            ValueError: ``value`` is not the tensor the plan says, or came twice.
            OSError: writing the file failed.
        """
        file = self.file_of[name]
        tensors = self._filling.setdefault(file, {})
        if TensorInfo.of(name, value) != self._infos[name] or name in tensors:
            info = self._infos[name]
            raise ValueError(
                f"{name}: {value.dtype} {tuple(value.shape)} is not the planned "
                f"{info.dtype} {info.shape}, or was written already"
            )
        tensors[name] = value.detach().to("cpu")
        self._left[file] -= 1
        if self._left[file] == 0:
            write_file(self.root / file, self._filling.pop(file))
            self.done.append(file)

    def abort(self) -> None:
        """Drop what is held and remove the files written (which no index lists yet)."""
        self._filling.clear()
        for file in self.done:
            (self.root / file).unlink(missing_ok=True)
        self.done.clear()


def commit(
    root: Path, weight_map: Mapping[str, str], metadata: Mapping[str, Any],
    configs: Mapping[str, str],
) -> None:  # fmt: skip
    """Make the shards of ``weight_map`` (all on disk) the checkpoint of ``root``: write
    ``configs`` (file name -> text) and the index, each replaced atomically, then remove
    the previous checkpoint's weight files and leftovers of saves that died."""
    old = set(read_weight_map(root).values())
    for name, text in configs.items():
        write_text(root / name, text)
    write_index(root, weight_map, metadata)
    new = set(weight_map.values())
    for p in root.iterdir():
        if p.name not in new and (p.name in old or p.name == SINGLE or SHARD.fullmatch(p.name)):
            p.unlink(missing_ok=True)


def configs_of(model: Any) -> dict[str, str] | None:
    """The texts of a transformers model's ``config.json`` (and ``generation_config.json``)
    as its ``save_pretrained`` writes them; None for a model without a config."""
    config: Any = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]  # as transformers' save_pretrained
    texts = {"config.json": config.to_json_string()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        texts["generation_config.json"] = generation.to_json_string()
    return texts


def read_configs(directory: Path) -> dict[str, str]:
    """The configs found in ``directory`` (``--config DIR``), by file name."""
    return {n: (directory / n).read_text() for n in CONFIGS if (directory / n).is_file()}


def weight_files(root: Path) -> list[str]:
    """The files of the checkpoint ``root`` holds now (``model.safetensors``, or the index
    and its shards)."""
    if not root.is_dir():
        return []
    names = [SINGLE] if (root / SINGLE).is_file() else []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        names += list(dict.fromkeys(read_weight_map(root).values()))
    if (root / INDEX).is_file():
        names.append(INDEX)
    return names
