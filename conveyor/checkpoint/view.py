"""The name-keyed view of a Pipeline (this rank's stages) or a plain module, and the
cross-rank helpers that work on it (gather, broadcast, raise on every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor, nn

from conveyor.checkpoint.errors import CheckpointError
from conveyor.errors import ConfigError
from conveyor.partition.resplit import trained_here
from conveyor.runtime.transport import guarded

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline


@dataclass
class Entry:
    """One tensor (or extra-state object) of this process, under all its local names."""

    names: list[tuple[int, int, str]]  # (stage, position in the stage's state dict, name)
    value: Any
    param: bool
    link: tuple[int, ...] | None = None  # ties this copy to copies on other ranks


@dataclass
class View:
    """What this process saves and loads: its stages' state, and where it sits."""

    entries: list[Entry]
    rank: int
    world_size: int
    distributed: bool
    layout: dict[str, Any] = field(default_factory=dict)


def is_pipeline(target: Any) -> bool:
    from conveyor.pipeline import Pipeline

    return isinstance(target, Pipeline)


def view_of(target: Pipeline | nn.Module, saving: bool = False) -> View:
    """Entries of a Pipeline (this rank's stages) or of a plain module (one process).

    ``saving`` a module that pipelines trained in a distributed world: every rank's
    entries are what it trained (:func:`~conveyor.partition.resplit.trained_here`), and
    the save is a collective of the world, as a pipeline's is.
    """
    keep: set[str] | None = None
    if isinstance(target, nn.Module):
        stages: list[tuple[int, nn.Module]] = [(0, target)]
        keep = trained_here(target) if saving else None
        layout = {"model": type(target).__name__}
        if keep is None:
            view = View([], 0, 1, False, layout)
        else:
            view = View([], dist.get_rank(), dist.get_world_size(), True, layout)
        links: dict[int, tuple[int, ...]] = {}
    elif is_pipeline(target):
        ctx = target.context
        stages = list(zip(target.held_stages, target.stages, strict=True))
        rows = target.vocab_layers
        if rows is not None:  # this rank's vocabulary rows, after every stage
            stages.append((target.schedule.stages, rows))
        view = View(
            [],
            ctx.rank,
            ctx.world_size,
            ctx.distributed,
            {
                "world_size": ctx.world_size,
                "pp": target.schedule.ranks,
                "dp": ctx.dp_size,
                "tp": ctx.tp_size,
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
    by_id: dict[int, Entry] = {}
    for s, stage in stages:
        params = {id(p) for p in stage.parameters()}
        for pos, (name, value) in enumerate(stage.state_dict(keep_vars=True).items()):
            if keep is not None and name not in keep:
                continue  # another rank trained it
            if isinstance(value, Tensor) and id(value) in by_id:
                by_id[id(value)].names.append((s, pos, name))
                continue
            entry = Entry([(s, pos, name)], value, id(value) in params, links.get(id(value)))
            view.entries.append(entry)
            if isinstance(value, Tensor):
                by_id[id(value)] = entry
    return view


def _tied_links(pipe: Pipeline) -> dict[int, tuple[int, ...]]:
    """``id(param) -> key`` for weights tied across ranks; copies share the key.

    ``pipe.tied_copies()`` lists, on every rank, its copies in the same global order with
    the group of ranks holding them, so the k-th copy of a group on one rank and the k-th
    on another are the same weight: the key is (group ranks..., k).
    """
    counts: dict[tuple[int, ...], int] = {}
    out: dict[int, tuple[int, ...]] = {}
    for param, ranks in pipe.tied_copies():
        k = counts.get(ranks, 0)
        counts[ranks] = k + 1
        out[id(param)] = (*ranks, k)
    return out


def set_extra(target: Pipeline | nn.Module, entry: Entry, value: Any) -> None:
    stages = [target] if isinstance(target, nn.Module) else target.stages
    if not isinstance(target, nn.Module) and target.vocab_layers is not None:
        stages = [*stages, target.vocab_layers]
    for stage in stages:
        own = stage.state_dict(keep_vars=True)
        part = {n: value for _, _, n in entry.names if n in own}
        if part:
            stage.load_state_dict(part, strict=False)


# --------------------------------------------------------------------------- collectives
def all_gather(view: View, value: Any) -> list[Any]:
    if not view.distributed:
        return [value]
    out: list[Any] = [None] * view.world_size
    guarded(
        lambda: dist.all_gather_object(out, value),
        f"rank {view.rank}: agreeing on the checkpoint with every rank",
        "another rank (every rank must call conveyor.save / conveyor.load)",
    )
    return out


def broadcast(view: View, value: Any) -> Any:
    if not view.distributed:
        return value
    box = [value]
    guarded(
        lambda: dist.broadcast_object_list(box, src=0),
        f"rank {view.rank}: agreeing on the checkpoint with rank 0",
        "rank 0 or another rank (every rank must call conveyor.save / conveyor.load)",
    )
    return box[0]


def raise_any(view: View, error: str | None) -> None:
    """Raise on every rank if any rank has an error, so none waits for the others."""
    errors = [(r, e) for r, e in enumerate(all_gather(view, error)) if e]
    if errors:
        if not view.distributed:
            raise CheckpointError(errors[0][1])
        raise CheckpointError(
            "; ".join(f"rank {r}: {e}" for r, e in errors[:2])
            + (f" (and {len(errors) - 2} more ranks)" if len(errors) > 2 else "")
        )
