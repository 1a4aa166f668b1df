"""``conveyor convert --to conveyor``: a transformers checkpoint directory (or one
``.safetensors`` file) as a conveyor checkpoint, tensor by tensor.

DCP saves a state dict of meta tensors; its planner reads each tensor from the safetensors
files (:class:`~conveyor.weights.sources.Safetensors`, through the ``safetensors``
package) only when DCP writes it, and frees it once written: one tensor (or one group
transformers converts together, such as a layer's experts) in memory at a time.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from conveyor.checkpoint import layout
from conveyor.checkpoint.streaming import Written, trim
from conveyor.errors import CheckpointError
from conveyor.storage import FORMAT, LATEST, VERSION, dcp_errors, quiet
from conveyor.weights.converted import Converted, conversion_mapping
from conveyor.weights.plan import Names
from conveyor.weights.sources import Safetensors


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
            trim()


def to_conveyor(src: Path, out: Path, model: nn.Module | None) -> Written:
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
    nbytes = sum(v.numel() * v.element_size() for v in planned.values())
    return Written(len(names), nbytes, [LATEST, ckpt_name])
