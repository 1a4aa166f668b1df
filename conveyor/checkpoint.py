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
                                       hyperparameters, the layout that saved it)

Keys inside DCP are ``model/<name>`` and ``optim/<name>/<state key>`` (``exp_avg``,
``step``, ...), with ``<name>`` as in the unsplit model. Each tensor is written once:
by the lowest rank holding it, so data-parallel replicas and the copies of a tied weight
on several ranks are not repeated; a tied weight is stored under its first name and
``conveyor.json`` lists its other names, and a load fills every copy from it.

A save is atomic: every rank writes into ``path/<name>.tmp``; only when all have
finished does rank 0 rename it to ``path/<name>`` and then replace ``path/latest``
(``os.replace``, atomic on POSIX). A save that dies halfway leaves ``latest`` naming the
previous checkpoint; the next successful save removes the leftovers. All ranks must see
the same ``path`` (one machine, or a shared file system).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from conveyor.errors import ConfigError, ConveyorError

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline

LATEST = "latest"
META = "conveyor.json"
FORMAT = "conveyor-checkpoint"
VERSION = 1

__all__ = ["CheckpointError", "exists", "load", "load_model_state", "save"]


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model it is loaded into."""


# --------------------------------------------------------------------------- local view
@dataclass
class _Entry:
    """One tensor (or extra-state object) of this process, under all its local names."""

    names: list[tuple[int, int, str]]  # (stage, position in the stage's state dict, name)
    value: Any
    param: bool
    link: tuple[int, ...] | None = None  # ties this copy to copies on other ranks


@dataclass
class _View:
    """What this process saves and loads: its stages' state, and where it sits."""

    entries: list[_Entry]
    rank: int
    world_size: int
    distributed: bool
    layout: dict[str, Any] = field(default_factory=dict)


def _is_pipeline(target: Any) -> bool:
    from conveyor.pipeline import Pipeline

    return isinstance(target, Pipeline)


def _view(target: Pipeline | nn.Module) -> _View:
    """Entries of a Pipeline (this rank's stages) or of a plain module (one process)."""
    if isinstance(target, nn.Module):
        stages: list[tuple[int, nn.Module]] = [(0, target)]
        view = _View([], 0, 1, False, {"model": type(target).__name__})
        links: dict[int, tuple[int, ...]] = {}
    elif _is_pipeline(target):
        ctx = target.context
        held = (
            target.schedule.stages_of(ctx.pp_rank)
            if ctx.distributed
            else tuple(range(target.schedule.stages))
        )
        stages = list(zip(sorted(held), target.stages, strict=True))
        view = _View(
            [],
            ctx.rank,
            ctx.world_size,
            ctx.distributed,
            {
                "world_size": ctx.world_size,
                "pp": ctx.pp_size,
                "dp": ctx.dp_size,
                "schedule": target.schedule.name,
                "stages": target.schedule.stages,
                "chunks": target.schedule.chunks,
            },
        )
        links = _tied_links(target)
    else:
        raise ConfigError(
            f"expected a conveyor.Pipeline or a torch.nn.Module, got {type(target).__name__}"
        )
    by_id: dict[int, _Entry] = {}
    for s, stage in stages:
        params = {id(p) for p in stage.parameters()}
        for pos, (name, value) in enumerate(stage.state_dict(keep_vars=True).items()):
            if isinstance(value, Tensor) and id(value) in by_id:
                by_id[id(value)].names.append((s, pos, name))
                continue
            entry = _Entry([(s, pos, name)], value, id(value) in params, links.get(id(value)))
            view.entries.append(entry)
            if isinstance(value, Tensor):
                by_id[id(value)] = entry
    return view


def _tied_links(pipe: Pipeline) -> dict[int, tuple[int, ...]]:
    """``id(param) -> key`` for weights tied across ranks; copies share the key.

    The pipeline's ``SharedParameters`` lists, on every rank, its copies in the same
    global order with the group of ranks holding them, so the k-th copy of a group on one
    rank and the k-th on another are the same weight: the key is (group ranks..., k).
    """
    shared = getattr(pipe, "_shared", None)
    entries = getattr(shared, "_entries", [])
    counts: dict[tuple[int, ...], int] = {}
    out: dict[int, tuple[int, ...]] = {}
    for param, group, *_ in entries:
        ranks = tuple(dist.get_process_group_ranks(group))
        k = counts.get(ranks, 0)
        counts[ranks] = k + 1
        out[id(param)] = (*ranks, k)
    return out


# --------------------------------------------------------------------------- collectives
def _all_gather(view: _View, value: Any) -> list[Any]:
    if not view.distributed:
        return [value]
    out: list[Any] = [None] * view.world_size
    dist.all_gather_object(out, value)
    return out


def _broadcast(view: _View, value: Any) -> Any:
    if not view.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _raise_any(view: _View, error: str | None) -> None:
    """Raise on every rank if any rank has an error, so none waits for the others."""
    errors = [(r, e) for r, e in enumerate(_all_gather(view, error)) if e]
    if errors:
        if not view.distributed:
            raise CheckpointError(errors[0][1])
        raise CheckpointError(
            "; ".join(f"rank {r}: {e}" for r, e in errors[:2])
            + (f" (and {len(errors) - 2} more ranks)" if len(errors) > 2 else "")
        )


# --------------------------------------------------------------------------- naming
def _components(infos: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, int]]:
    """From every rank's entries: canonical name of every name, and the writing rank of
    every canonical name (the lowest rank holding any copy)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    linked: dict[tuple[int, ...], str] = {}
    first: dict[str, tuple[int, int, str]] = {}
    for info in infos:
        for names, link in info["entries"]:
            for s, pos, name in names:
                union(names[0][2], name)
                first[name] = min(first.get(name, (s, pos, name)), (s, pos, name))
            if link is not None:
                union(linked.setdefault(tuple(link), names[0][2]), names[0][2])
    best: dict[str, tuple[int, int, str]] = {}
    for name, where in first.items():
        root = find(name)
        best[root] = min(best.get(root, where), where)
    canon = {name: best[find(name)][2] for name in first}
    writer: dict[str, int] = {}
    for rank, info in enumerate(infos):
        for names, _ in info["entries"]:
            writer.setdefault(canon[names[0][2]], rank)
    return canon, writer


def _hyper_json(group: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer param group's hyperparameters as JSON values (tuples as lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, Tensor):
            return v.tolist()
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(type(v).__name__)

    out: dict[str, Any] = {}
    for k, v in group.items():
        if k != "params":
            with contextlib.suppress(TypeError):  # kept as the optimizer has it on load
                out[k] = plain(v)
    return out


def _hyper_restore(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters in the types of the current group's (tuple, tensor, ...)."""
    out = {k: v for k, v in current.items() if k != "params"}
    for k, v in saved.items():
        cur = current.get(k)
        if isinstance(cur, Tensor):
            out[k] = torch.tensor(v, dtype=cur.dtype, device=cur.device)
        elif isinstance(cur, tuple):
            out[k] = tuple(v)
        else:
            out[k] = v
    return out


def _optimizer_index(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """``id(param) -> (index in optimizer.state_dict()['state'], param group)``."""
    out: dict[int, tuple[int, int]] = {}
    i = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            out.setdefault(id(p), (i, g))
            i += 1
    return out


# --------------------------------------------------------------------------- paths
def _resolve(path: str | os.PathLike[str]) -> Path:
    """The directory of the current checkpoint at ``path``."""
    root = Path(path)
    latest = root / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        current = root / name
        if not (current / META).is_file():
            raise CheckpointError(
                f"{latest} names {name!r}, but {current / META} is missing: the checkpoint "
                f"was deleted or moved; restore it or start from another checkpoint"
            )
        return current
    if (root / META).is_file():
        return root  # a checkpoint directory itself (path/step-...)
    if not root.exists():
        raise CheckpointError(
            f"no checkpoint at {root}: the path does not exist; check it, or start "
            f"without loading (conveyor.checkpoint.exists(path) tells whether one is there)"
        )
    unfinished = sorted(p.name for p in root.glob("*.tmp"))
    hint = f" (it holds only unfinished saves: {', '.join(unfinished)})" if unfinished else ""
    raise CheckpointError(
        f"no checkpoint at {root}: no {LATEST} file{hint}; pass a directory written by "
        f"conveyor.save, or start without loading"
    )


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a checkpoint to resume from (unfinished saves do not count).

    True also when ``path/latest`` names a checkpoint that has gone missing, so that a
    resuming script calls :func:`load` and stops with that error instead of silently
    starting over.
    """
    root = Path(path)
    return (root / LATEST).is_file() or (root / META).is_file()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit(root: Path, name: str, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote ``root/name.tmp``: make it the current checkpoint."""
    tmp = root / f"{name}.tmp"
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, root / name)
    _fsync_dir(root)
    pointer = root / f"{LATEST}.{name}.tmp"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)  # the commit point
    _fsync_dir(root)
    # Older checkpoints and leftovers of saves that died; only names this module writes.
    for old in root.iterdir():
        if old.name == name:
            continue
        if (
            old.is_dir()
            and old.name.startswith(("step-", "nostep-"))
            and (old.name.endswith(".tmp") or (old / META).is_file())
        ):
            shutil.rmtree(old, ignore_errors=True)
        elif old.is_file() and old.name.startswith(f"{LATEST}.") and old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process whenever ``no_dist`` is set; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        yield


@contextlib.contextmanager
def _dcp_errors(doing: str, then: str) -> Iterator[None]:
    """DCP's failures (a ``BaseException`` carrying every rank's error) as CheckpointError."""
    try:
        yield
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        first, _ = exc.failures[ranks[0]]
        raise CheckpointError(
            f"{doing} failed on rank(s) {ranks}: {type(first).__name__}: {first}; {then}"
        ) from exc


# --------------------------------------------------------------------------- save
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
    rank has finished, ``path`` keeps naming the previous checkpoint. ``pipe`` may also be
    a plain ``nn.Module`` (one process).
    """
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ConfigError(f"step must be an int >= 0 or None, got {step!r}")
    view = _view(pipe)
    root = Path(path)
    error = None
    if root.exists() and not root.is_dir():
        error = f"cannot save to {root}: it is a file; checkpoints are directories"
    opt_index = _optimizer_index(optimizer) if optimizer is not None else {}
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
    info = {
        "entries": [(e.names, e.link) for e in view.entries],
        "groups": [_hyper_json(g) for g in opt_sd["param_groups"]]
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
    infos = _all_gather(view, info)
    _raise_any(view, error)
    with_opt = [i["class"] is not None for i in infos]
    if any(with_opt) and not all(with_opt):
        raise CheckpointError(
            "some ranks passed an optimizer to conveyor.save and some did not; pass each "
            "rank's optimizer on every rank (or none anywhere)"
        )
    canon, writer = _components(infos)

    # What this rank writes: each entry whose canonical name this rank is the writer of.
    state: dict[str, Any] = {}
    for e in view.entries:
        c = canon[e.names[0][2]]
        if writer[c] != view.rank or f"model/{c}" in state:
            continue
        state[f"model/{c}"] = _pack(e.value)
        if e.param and id(e.value) in opt_index:
            for k, v in opt_state.get(opt_index[id(e.value)][0], {}).items():
                state[f"optim/{c}/{k}"] = _pack(v)

    name = f"step-{step:08d}" if step is not None else "nostep"
    name = _broadcast(view, f"{name}-{secrets.token_hex(4)}" if view.rank == 0 else None)
    with _quiet(), _dcp_errors(f"saving a checkpoint to {root}", "the previous one is kept"):
        # Every rank creates the directory (DCP's writer does) and writes its files.
        dcp_save(
            state,
            storage_writer=FileSystemWriter(root / f"{name}.tmp"),
            no_dist=not view.distributed,
        )

    commit_error = None
    if view.rank == 0:
        try:
            _commit(root, name, _meta(infos, canon, writer, view, step))
        except Exception as exc:  # tell every rank, then fail everywhere
            commit_error = f"committing checkpoint {root / name} failed: {exc!r}"
    commit_error = _broadcast(view, commit_error)
    if commit_error:
        raise CheckpointError(commit_error)


def _meta(
    infos: list[dict[str, Any]],
    canon: dict[str, str],
    writer: dict[str, int],
    view: _View,
    step: int | None,
) -> dict[str, Any]:
    """conveyor.json: step, names in model order, aliases, optimizer hyperparameters."""
    order = sorted({(s, pos, n) for i in infos for names, _ in i["entries"] for s, pos, n in names})
    keys = list(dict.fromkeys(n for _, _, n in order))
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "saved_by": view.layout,
        "keys": keys,
        "aliases": {n: c for n, c in canon.items() if n != c},
        "optimizer": None,
    }
    if infos[0]["class"] is None:
        return meta
    groups: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    group_of: dict[str, int] = {}
    with_state: list[str] = []
    for rank, info in enumerate(infos):
        for (names, _), g, has in zip(
            info["entries"], info["group_of"], info["has_state"], strict=True
        ):
            c = canon[names[0][2]]
            if writer[c] != rank or g is None or c in group_of:
                continue
            hyper = info["groups"][g]
            key = json.dumps(hyper, sort_keys=True)
            if key not in seen:
                seen[key] = len(groups)
                groups.append(hyper)
            group_of[c] = seen[key]
            if has:
                with_state.append(c)
    meta["optimizer"] = {
        "class": infos[0]["class"],
        "param_groups": groups,
        "group_of": group_of,
        "with_state": with_state,
    }
    return meta


# --------------------------------------------------------------------------- load
def _read(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], Metadata]:
    where = _resolve(path)
    meta = json.loads((where / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{where / META} is not a conveyor checkpoint's metadata")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{where} was written by a newer conveyor (format {meta['version']}); upgrade "
            f"conveyor to load it"
        )
    metadata = FileSystemReader(where).read_metadata()
    return where, meta, metadata


def _pack(value: Any) -> Any:
    """A tensor as is (detached); anything else pickled into one opaque blob, so that DCP
    does not flatten a dict (a module's extra state, say) into keys of its own."""
    if isinstance(value, Tensor):
        return value.detach()
    blob = io.BytesIO()
    torch.save(value, blob)
    return blob.getvalue()


def _unpack(value: Any) -> Any:
    """What :func:`_pack` stored, back."""
    if isinstance(value, bytes):
        return torch.load(io.BytesIO(value), weights_only=False)
    return value


def _empty(md: Any) -> Any:
    """A tensor to load a stored tensor into, or a placeholder for a stored object."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def load(
    pipe: Pipeline | nn.Module,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> int | None:
    """Load the checkpoint at ``path`` into this rank's stages (and ``optimizer``).

    Returns the ``step`` it was saved with. A collective in a distributed world: call it
    on every rank. Works whatever split, schedule, stage count or process count saved it;
    each copy of a tied weight is filled from the one stored copy. ``optimizer`` must be
    built over this rank's parameters (``pipe.parameters()``); its hyperparameters
    (learning rate, ...) are restored too. ``pipe`` may also be a plain ``nn.Module``.
    """
    view = _view(pipe)
    read: tuple[Path, dict[str, Any], Metadata] | None = None
    try:
        read = _read(path)
    except (CheckpointError, OSError) as exc:
        _raise_any(view, str(exc))
    _raise_any(view, None)
    assert read is not None
    where, meta, metadata = read
    error = None
    stored = metadata.state_dict_metadata
    aliases: dict[str, str] = meta["aliases"]
    opt_meta = meta.get("optimizer")

    problems: list[str] = []
    state: dict[str, Any] = {}
    copies: list[tuple[Tensor, str]] = []
    chosen: list[str | None] = []
    for e in view.entries:
        names = [n for _, _, n in e.names]
        c = next((aliases.get(n, n) for n in names if f"model/{aliases.get(n, n)}" in stored), None)
        chosen.append(c)
        if c is None:
            problems.append(names[0])
            continue
        md = stored[f"model/{c}"]
        if isinstance(e.value, Tensor):
            if error is not None:
                pass
            elif not isinstance(md, TensorStorageMetadata):
                error = f"checkpoint entry {c!r} is not a tensor, but the model's {names[0]} is"
            elif tuple(md.size) != tuple(e.value.shape):
                error = (
                    f"checkpoint {where} has {c} of shape {tuple(md.size)}, but this model's "
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
            f"checkpoint {where} lacks {len(problems)} entries this "
            f"{'pipeline' if _is_pipeline(pipe) else 'model'} needs, e.g. {problems[:3]}; it "
            f"was saved from a different model (it has e.g. "
            f"{[k[6:] for k in list(stored) if k.startswith('model/')][:3]}). Load it into "
            f"the model it was saved from, or load the matching part with "
            f"pipe.load_state_dict(conveyor.load_model_state(path), strict=False)"
        )
    opt_index = _optimizer_index(optimizer) if optimizer is not None else {}
    if optimizer is not None and error is None:
        if opt_meta is None:
            error = (
                f"checkpoint {where} has no optimizer state (it was saved without "
                f"optimizer=); load without optimizer= or save with it"
            )
        elif opt_meta["class"] != type(optimizer).__name__:
            error = (
                f"checkpoint {where} holds {opt_meta['class']} state, but the optimizer is "
                f"{type(optimizer).__name__}; build the same optimizer it was saved with"
            )
        else:
            for e, c in zip(view.entries, chosen, strict=True):
                if c is None or not e.param or id(e.value) not in opt_index:
                    continue
                prefix = f"optim/{c}/"
                for k, md in stored.items():
                    if k.startswith(prefix) and "/" not in k[len(prefix) :]:
                        state[k] = _empty(md)
    _raise_any(view, error)

    with _quiet(), _dcp_errors(f"loading checkpoint {where}", "is it damaged?"):
        dcp_load(
            state,
            storage_reader=FileSystemReader(where),
            no_dist=not view.distributed,
        )
    with torch.no_grad():
        for dst, key in copies:
            dst.copy_(state[key])
    # Extra (non-tensor) module state comes back as objects: hand them to their modules.
    for e, c in zip(view.entries, chosen, strict=True):
        if not isinstance(e.value, Tensor) and c is not None:
            _set_extra(pipe, e, _unpack(state[f"model/{c}"]))

    if optimizer is not None and opt_meta is not None:
        _load_optimizer(optimizer, opt_index, view, chosen, state, opt_meta)
    step = meta.get("step")
    return int(step) if step is not None else None


def _set_extra(target: Pipeline | nn.Module, entry: _Entry, value: Any) -> None:
    stages = [target] if isinstance(target, nn.Module) else target.stages
    for stage in stages:
        own = stage.state_dict(keep_vars=True)
        part = {n: value for _, _, n in entry.names if n in own}
        if part:
            stage.load_state_dict(part, strict=False)


def _load_optimizer(
    optimizer: torch.optim.Optimizer,
    opt_index: dict[int, tuple[int, int]],
    view: _View,
    chosen: list[str | None],
    state: dict[str, Any],
    opt_meta: dict[str, Any],
) -> None:
    """Build ``optimizer``'s state dict from the loaded entries, by parameter name."""
    per_param: dict[int, dict[str, Any]] = {}
    group_of: dict[int, int] = {}
    for e, c in zip(view.entries, chosen, strict=True):
        if c is None or not e.param or id(e.value) not in opt_index:
            continue
        i, g = opt_index[id(e.value)]
        prefix = f"optim/{c}/"
        entries = {k[len(prefix) :]: _unpack(v) for k, v in state.items() if k.startswith(prefix)}
        if entries:
            per_param[i] = entries
        if c in opt_meta["group_of"] and g not in group_of:
            group_of[g] = opt_meta["group_of"][c]
    current = optimizer.state_dict()
    groups = []
    for g, group in enumerate(current["param_groups"]):
        saved = opt_meta["param_groups"][group_of[g]] if g in group_of else {}
        groups.append({**_hyper_restore(saved, group), "params": group["params"]})
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def load_model_state(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The unsplit model's state dict from the checkpoint at ``path``, in one process.

    ``model.load_state_dict(conveyor.load_model_state(path))`` works for the model the
    checkpoint was saved from, whatever split saved it; a tied weight appears under each
    of its names (as in ``model.state_dict()``). No process group is needed. For the
    optimizer too, use ``conveyor.load(model, path, optimizer)``.
    """
    where, meta, metadata = _read(path)
    stored = metadata.state_dict_metadata
    state = {k: _empty(md) for k, md in stored.items() if k.startswith("model/")}
    with _quiet(), _dcp_errors(f"loading checkpoint {where}", "is it damaged?"):
        dcp_load(state, storage_reader=FileSystemReader(where), no_dist=True)
    aliases: dict[str, str] = meta["aliases"]
    out: dict[str, Any] = {}
    for name in meta["keys"]:
        key = f"model/{aliases.get(name, name)}"
        if key not in state:
            raise CheckpointError(
                f"checkpoint {where} lists {name!r} but holds no data for it; it is damaged, "
                f"load an earlier one"
            )
        out[name] = _unpack(state[key])
    return out
