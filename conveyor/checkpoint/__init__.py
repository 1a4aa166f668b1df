"""Checkpoints keyed by the original model's names, loadable into any split.

``save(pipe, path, optimizer, step)`` writes this rank's part of the model and optimizer
state with ``torch.distributed.checkpoint`` (DCP); ``load(pipe, path, optimizer)`` reads
back exactly the entries this rank needs, whatever split, schedule, stage count or data
parallel size saved them; ``load_model_state(path)`` gives the plain model's state dict in
one process.

On disk, ``path`` is a directory::

    path/latest                        the name of the current checkpoint (one line)
    path/step-00000120-3fa94c1e/       one checkpoint: DCP's ``.metadata`` and
                                       ``__<rank>_0.distcp`` files, and conveyor.json
                                       (step, aliases of tied weights, optimizer
                                       hyperparameters, the model class or
                                       pipeline sizes that saved it)

Keys inside DCP are ``model/<name>`` and ``optim/<name>/<state key>`` (``exp_avg``,
``step``, ...), with ``<name>`` as in the unsplit model. Each tensor is written once:
by the lowest rank holding it, so data-parallel replicas and the copies of a tied weight
on several ranks are not repeated; a tied weight is stored under its first name and
``conveyor.json`` lists its other names, and a load fills every copy from it.

A save is atomic: every rank writes into ``path/<checkpoint>.tmp``; only when all have
finished does rank 0 rename it to ``path/<checkpoint>`` and then replace ``path/latest``
(``os.replace``, atomic on POSIX). A save that dies halfway leaves ``latest`` naming the
previous checkpoint; the next successful save removes the leftovers. All ranks must see
the same ``path`` (one machine, or a shared file system).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from conveyor.checkpoint.dcp import empty_for, empty_like_for, is_sharded, pack, unpack
from conveyor.checkpoint.errors import CheckpointError
from conveyor.checkpoint.layout import commit, new_name
from conveyor.checkpoint.meta import build_meta, read_checkpoint
from conveyor.checkpoint.naming import components
from conveyor.checkpoint.optimizer import hyper_json, load_optimizer, optimizer_index
from conveyor.checkpoint.view import (
    all_gather,
    broadcast,
    is_pipeline,
    raise_any,
    set_extra,
    view_of,
)
from conveyor.errors import ConfigError
from conveyor.storage import dcp_errors, exists, quiet, without_weights

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline

__all__ = ["CheckpointError", "exists", "load", "load_model_state", "save"]


def save(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
) -> None:
    """Save the model (and ``optimizer``'s state, and ``step``) as the checkpoint at ``path``.

    A collective in a distributed world: call it on every rank, with each rank's own
    optimizer. Each rank writes only its entries, under the original model's names, so
    any other split, schedule or process count can :func:`load` it. Atomic: until every
    rank has finished, ``path`` keeps naming the previous checkpoint; the older
    checkpoints in ``path`` are removed after the new one is committed.

    Args:
        pipe: The pipeline, or a plain ``nn.Module``: in one process; or, in a distributed
            world, the model pipelines trained (each rank writes what it trained: call it
            on every rank).
        path: The checkpoint directory, created if missing; every rank must see the same
            one.
        optimizer: This rank's optimizer, built from ``pipe.parameters()``; its state and
            hyperparameters are saved too. Pass one on every rank or on none.
        step: The training step to record (an int >= 0), returned by :func:`load`.

    Raises:
        ConfigError: For a ``step`` that is not an int >= 0, or a ``pipe`` that is neither
            a Pipeline nor an ``nn.Module``.
        CheckpointError: If ``path`` is a file, the optimizer holds parameters that are
            not this rank's, only some ranks pass an optimizer, or writing fails (then
            the previous checkpoint stays current).
        PipelineError: If another rank does not reach the save within the time-out.
    """
    _save(pipe, path, optimizer, step, weights=True)


def save_training_state(
    pipe: Pipeline,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
) -> None:
    """:func:`save` without the weights: the optimizer's state and the step, for a trainer
    that writes the weights beside it with ``save_pretrained`` (stored once, not twice).
    :func:`load_training_state` reads it back; :func:`load` refuses it."""
    _save(pipe, path, optimizer, step, weights=False)


def _save(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    weights: bool,
) -> None:
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ConfigError(f"step must be an int >= 0 or None, got {step!r}")
    view = view_of(pipe, saving=True)
    root = Path(path)
    error = None
    if root.exists() and not root.is_dir():
        error = f"cannot save to {root}: it is a file; checkpoints are directories"
    opt_index = optimizer_index(optimizer) if optimizer is not None else {}
    local_params = {id(e.value) for e in view.entries if e.param}
    if optimizer is not None and error is None:
        foreign = [i for pid, (i, _) in opt_index.items() if pid not in local_params]
        if foreign:
            error = (
                f"the optimizer holds {len(foreign)} parameters that are not this "
                f"{'pipeline' if view.layout.get('pp') else 'model'}'s on this rank; build "
                f"it from pipe.parameters()"
            )
    opt_sd = optimizer.state_dict() if optimizer is not None else {"state": {}}
    opt_state = opt_sd["state"]
    # What this rank tells the others (and rank 0's conveyor.json) about its entries.
    report = {
        "entries": [(e.names, e.link) for e in view.entries],
        "param_groups": [hyper_json(g) for g in opt_sd["param_groups"]]
        if optimizer is not None
        else None,
        "group_of": [
            opt_index[id(e.value)][1] if e.param and id(e.value) in opt_index else None
            for e in view.entries
        ],
        "has_state": [
            bool(e.param and id(e.value) in opt_index and opt_index[id(e.value)][0] in opt_state)
            for e in view.entries
        ],
        "class": type(optimizer).__name__ if optimizer is not None else None,
    }
    reports = all_gather(view, report)
    raise_any(view, error)
    with_opt = [r["class"] is not None for r in reports]
    if any(with_opt) and not all(with_opt):
        raise CheckpointError(
            "some ranks passed an optimizer to conveyor.save and some did not; pass each "
            "rank's optimizer on every rank (or none anywhere)"
        )
    canon, writer = components(reports)

    # What this rank writes: each entry whose canonical name this rank is the writer of.
    state: dict[str, Any] = {}
    done: set[str] = set()
    for e in view.entries:
        c = canon[e.names[0][2]]
        # A sharded (DTensor) value is written by every rank holding a shard of it; DCP
        # keeps one copy of a shard several ranks hold.
        if (writer[c] != view.rank and not is_sharded(e.value)) or c in done:
            continue
        done.add(c)
        if weights:
            state[f"model/{c}"] = pack(e.value)
        if e.param and id(e.value) in opt_index:
            for k, v in opt_state.get(opt_index[id(e.value)][0], {}).items():
                state[f"optim/{c}/{k}"] = pack(v)

    ckpt_name = broadcast(view, new_name(step) if view.rank == 0 else None)
    with quiet(), dcp_errors(f"saving a checkpoint to {root}", "the previous one is kept"):
        # Every rank creates the directory (DCP's writer does) and writes its files.
        dcp_save(
            state,
            storage_writer=FileSystemWriter(root / f"{ckpt_name}.tmp"),
            no_dist=not view.distributed,
        )

    commit_error = None
    if view.rank == 0:
        try:
            meta = build_meta(reports, canon, writer, view, step)
            commit(root, ckpt_name, {**meta, "weights": weights})
        except Exception as exc:  # tell every rank, then fail everywhere
            commit_error = f"committing checkpoint {root / ckpt_name} failed: {exc!r}"
    commit_error = broadcast(view, commit_error)
    if commit_error:
        raise CheckpointError(commit_error)


def load(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> int | None:
    """Load the checkpoint at ``path`` into this rank's stages (and ``optimizer``).

    A collective in a distributed world: call it on every rank. Works whatever split,
    schedule, stage count or process count saved it; each copy of a tied weight is
    filled from the one stored copy.

    Args:
        pipe: The pipeline, or a plain ``nn.Module``.
        path: A directory written by :func:`save` (or one checkpoint's directory in it).
        optimizer: This rank's optimizer, built over ``pipe.parameters()``; its state and
            hyperparameters (learning rate, ...) are restored too.

    Returns:
        The ``step`` the checkpoint was saved with, or None if it was saved without one.

    Raises:
        ConfigError: For a ``pipe`` that is neither a Pipeline nor an ``nn.Module``.
        CheckpointError: If there is no checkpoint at ``path``, it is damaged or from a
            newer conveyor, it lacks entries the model needs or has other shapes, or it
            has no or another optimizer's state when ``optimizer`` is given.
        PipelineError: If another rank does not reach the load within the time-out.
    """
    return _load(pipe, path, optimizer, weights=True)


def load_training_state(
    pipe: Pipeline, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
) -> int | None:
    """Read what :func:`save_training_state` wrote (or the optimizer part of what
    :func:`save` wrote) into ``optimizer``; the weights are left as they are."""
    return _load(pipe, path, optimizer, weights=False)


def _load(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None,
    weights: bool,
) -> int | None:
    view = view_of(pipe)
    read: tuple[Path, dict[str, Any], Metadata] | None = None
    failure = None
    try:
        read = read_checkpoint(path)
    except (CheckpointError, OSError) as exc:
        failure = str(exc)  # raised below, on every rank, as one error (not two)
    raise_any(view, failure)
    assert read is not None
    ckpt_dir, meta, metadata = read
    error = None
    stored = metadata.state_dict_metadata
    aliases: dict[str, str] = meta["aliases"]
    opt_meta = meta.get("optimizer")

    problems: list[str] = []
    state: dict[str, Any] = {}
    copies: list[tuple[Tensor, str]] = []
    chosen: list[str | None] = []
    if weights and meta.get("weights") is False and error is None:
        error = without_weights(ckpt_dir)
    known = {f"model/{k}" for k in meta["keys"]} if not weights else set(stored)
    for e in view.entries:
        names = [n for _, _, n in e.names]
        c = next((aliases.get(n, n) for n in names if f"model/{aliases.get(n, n)}" in known), None)
        chosen.append(c)
        if c is None:
            problems.append(names[0])
            continue
        if not weights:
            continue
        md = stored[f"model/{c}"]
        if isinstance(e.value, Tensor):
            if error is not None:
                pass
            elif not isinstance(md, TensorStorageMetadata):
                error = f"checkpoint entry {c!r} is not a tensor, but the model's {names[0]} is"
            elif tuple(md.size) != tuple(e.value.shape):
                error = (
                    f"checkpoint {ckpt_dir} has {c} of shape {tuple(md.size)}, but this model's "
                    f"{names[0]} has shape {tuple(e.value.shape)}; build the model with the "
                    f"same sizes it was saved with"
                )
            if f"model/{c}" in state:  # tied in the checkpoint, separate here: fill both
                copies.append((e.value, f"model/{c}"))
            else:
                state[f"model/{c}"] = e.value.detach()
        else:
            state[f"model/{c}"] = None
    if problems and error is None:
        error = (
            f"checkpoint {ckpt_dir} lacks {len(problems)} entries this "
            f"{'pipeline' if is_pipeline(pipe) else 'model'} needs, e.g. {problems[:3]}; it "
            f"was saved from a different model (it has e.g. "
            f"{[k[6:] for k in list(stored) if k.startswith('model/')][:3]}). Load it into "
            f"the model it was saved from, or load the matching part with "
            f"pipe.load_state_dict(conveyor.load_model_state(path), strict=False)"
        )
    opt_index = optimizer_index(optimizer) if optimizer is not None else {}
    if optimizer is not None and error is None:
        if opt_meta is None:
            error = (
                f"checkpoint {ckpt_dir} has no optimizer state (it was saved without "
                f"optimizer=); load without optimizer= or save with it"
            )
        elif opt_meta["class"] != type(optimizer).__name__:
            error = (
                f"checkpoint {ckpt_dir} holds {opt_meta['class']} state, but the optimizer is "
                f"{type(optimizer).__name__}; build the same optimizer it was saved with"
            )
        else:
            for e, c in zip(view.entries, chosen, strict=True):
                if c is None or not e.param or id(e.value) not in opt_index:
                    continue
                prefix = f"optim/{c}/"
                for k, md in stored.items():
                    if k.startswith(prefix) and "/" not in k[len(prefix) :]:
                        state[k] = empty_like_for(md, e.value)
    raise_any(view, error)

    with quiet(), dcp_errors(f"loading checkpoint {ckpt_dir}", "is it damaged?"):
        dcp_load(
            state,
            storage_reader=FileSystemReader(ckpt_dir),
            no_dist=not view.distributed,
        )
    with torch.no_grad():
        for dst, key in copies:
            dst.copy_(state[key])
    # Extra (non-tensor) module state comes back as objects: hand them to their modules.
    for e, c in zip(view.entries, chosen, strict=True):
        if weights and not isinstance(e.value, Tensor) and c is not None:
            set_extra(pipe, e, unpack(state[f"model/{c}"]))

    if optimizer is not None and opt_meta is not None:
        load_optimizer(optimizer, opt_index, view, chosen, state, opt_meta)
    step = meta.get("step")
    return int(step) if step is not None else None


def load_model_state(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The unsplit model's state dict from the checkpoint at ``path``, in one process.

    ``model.load_state_dict(conveyor.load_model_state(path))`` works for the model the
    checkpoint was saved from, whatever split saved it. No process group is needed. For
    the optimizer too, use ``conveyor.load(model, path, optimizer)``.

    Args:
        path: A directory written by :func:`save` (or one checkpoint's directory in it).

    Returns:
        The state dict under the unsplit model's names, in its order; a tied weight
        appears under each of its names (as in ``model.state_dict()``).

    Raises:
        CheckpointError: If there is no checkpoint at ``path``, or it is damaged or from
            a newer conveyor.
    """
    ckpt_dir, meta, metadata = read_checkpoint(path)
    if meta.get("weights") is False:
        raise CheckpointError(without_weights(ckpt_dir))
    stored = metadata.state_dict_metadata
    state = {k: empty_for(md) for k, md in stored.items() if k.startswith("model/")}
    with quiet(), dcp_errors(f"loading checkpoint {ckpt_dir}", "is it damaged?"):
        dcp_load(state, storage_reader=FileSystemReader(ckpt_dir), no_dist=True)
    aliases: dict[str, str] = meta["aliases"]
    out: dict[str, Any] = {}
    for name in meta["keys"]:
        key = f"model/{aliases.get(name, name)}"
        if key not in state:
            raise CheckpointError(
                f"checkpoint {ckpt_dir} lists {name!r} but holds no data for it; it is damaged, "
                f"load an earlier one"
            )
        out[name] = unpack(state[key])
    return out
