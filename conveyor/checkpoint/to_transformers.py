"""``conveyor convert --to transformers``: a conveyor checkpoint (:func:`conveyor.save`, any
layout) as a transformers directory, tensor by tensor.

DCP reads the tensors of a batch whole (a batch: tensors up to ``buffer`` bytes, or one
larger tensor); each goes, in the layout the model's own ``save_pretrained`` writes
(:class:`~conveyor.checkpoint.published.Published`), to its shard, which is written once
its last tensor has come (:class:`~conveyor.checkpoint.hf_dir.Shards`): at most one file's
tensors (``max_shard_size``, or one larger tensor) and one batch are in memory at a time.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conveyor.checkpoint.hf_dir import Shards, commit, free_names, read_configs
from conveyor.checkpoint.published import Published
from conveyor.checkpoint.streaming import Written, trim
from conveyor.errors import CheckpointError
from conveyor.storage import read_checkpoint
from conveyor.weights.safetensors_file import INDEX, TensorInfo, pack, runs
from conveyor.weights.sources import ConveyorCheckpoint

NO_CONFIG = (
    "no config.json was written to {out}: transformers' from_pretrained needs one; pass "
    "config= (--config DIR) with the model's transformers config directory to add it"
)


def to_transformers(
    src: Path, out: Path, model: nn.Module | None, config: Path | None, limit: int, buffer: int
) -> Written:
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
            trim()
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
    return Written(len(infos), nbytes, written, note)
