"""Tensor parallelism and FSDP2 on this rank's stages, with the schedule driving FSDP.

Both use torch's own engines: :func:`torch.distributed.tensor.parallel.parallelize_module`
with the user's ``ParallelStyle`` s on the ``tp`` mesh dimension, and
:func:`torch.distributed.fsdp.fully_shard` on the ``dp`` dimension. What conveyor adds is
when FSDP gathers and reduces. Left to its own hooks, FSDP would all-gather a stage's
parameters for every micro-batch's forward and backward and reduce-scatter after each
backward. Here the runtime knows the schedule, so by default each stage is one FSDP unit
that is gathered once, before the stage's first action of the step (all of this rank's
stages are started then, in the order the schedule uses them, and each is waited for
right before its first action), kept gathered through every F, B and W of the step, and
reduce-scattered and resharded once after the stage's last B / W: one all-gather and one
reduce-scatter per stage per step. ``fsdp="reshard"`` instead wraps every block as a unit
with FSDP's own gather-per-use and reshard-after-use (the least memory; schedules that
split the backward need the gathered weights from B to W, so it takes the others only).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor._groups import on_release
from conveyor.errors import ConfigError
from conveyor.partition.methods import called_modules
from conveyor.runtime import fsdp_state
from conveyor.runtime.local_part import local_shard as local_shard  # its callers import it here
from conveyor.runtime.program import RankProgram
from conveyor.runtime.step_sync import StepSync
from conveyor.schedules import Action


def summed(t: torch.Tensor) -> torch.Tensor:
    """A DTensor of partial sums with its sums done (a collective over those mesh
    dimensions): the gradient of a replicated parameter that ran on this rank's slice of
    its input (``SequenceParallel``: a norm on the local heads or tokens). Other tensors as
    they are."""
    placements = getattr(t, "placements", ())
    if not any(p.is_partial() for p in placements):
        return t
    from torch.distributed.tensor import DTensor, Replicate

    assert isinstance(t, DTensor)
    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in placements])


def apply_tp(
    stages: dict[int, nn.Module],
    tp_plan: Mapping[str, Any],
    names: Iterable[str],
    mesh: Any,
    every: Iterable[nn.Module] = (),
) -> None:
    """Parallelize each stage's modules that ``tp_plan`` names (fnmatch patterns over the
    original model's module names) on the ``tp`` mesh ``mesh``: the modules a graph calls
    (an fx capture's leaf modules, the modules an export capture keeps whole for the plan:
    :mod:`conveyor.runtime.tp_export`). The ``tp_plan`` is first checked
    on ``every`` stage of the split (every rank's), so that each rank raises the same
    error, not only the ranks that hold the module (the others would wait on them)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    known = list(names)
    size = mesh.size()
    for pattern, style in tp_plan.items():
        if not isinstance(style, ParallelStyle):
            raise ConfigError(
                f"tp_plan[{pattern!r}] is a {type(style).__name__}; give a torch ParallelStyle, "
                f"e.g. ColwiseParallel() or RowwiseParallel() from "
                f"torch.distributed.tensor.parallel"
            )
        if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
            raise ConfigError(
                f"tp_plan pattern {pattern!r} matches no module of the model; patterns match "
                f"module names as in model.named_modules(), e.g. 'blocks.*.attn.q_proj'"
            )

    def chosen(stage: nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, module in stage.named_modules():
            for pattern, style in tp_plan.items():
                if name and fnmatch.fnmatchcase(name, pattern):
                    _check_divisible(name, module, style, size)
                    out[name] = style
                    break
        return out

    for stage in every:
        chosen(stage)
    for stage in stages.values():
        styles = chosen(stage)
        if styles:
            frozen = {n for n, p in stage.named_parameters() if not p.requires_grad}
            parallelize_module(stage, mesh, styles)
            # torch before 2.13 makes every sharded parameter trainable
            for name, p in stage.named_parameters():
                if name in frozen:
                    p.requires_grad_(False)


def _check_divisible(name: str, module: nn.Module, style: Any, size: int) -> None:
    """The dimension ``style`` shards must split evenly into ``size`` parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[type, tuple[str, str]] = {
        nn.Linear: ("out_features", "in_features"),
        nn.Embedding: ("embedding_dim", "num_embeddings"),
    }
    kind = next((dims[t] for t in dims if isinstance(module, t)), None)
    if kind is None:
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise ConfigError(
                f"tp_plan gives model.{name} ({type(module).__name__}) a "
                f"{type(style).__name__}, which shards nn.Linear and nn.Embedding only; "
                f"name the Linear / Embedding modules inside it"
            )
        return
    field = kind[0] if isinstance(style, ColwiseParallel) else kind[1]
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and getattr(module, field) % size:
        raise ConfigError(
            f"tp_plan cannot shard model.{name}: {type(style).__name__} splits its "
            f"{field} = {getattr(module, field)} over tp = {size} ranks, which does not "
            f"divide it; use a tp that divides {getattr(module, field)} or leave the module "
            f"out of tp_plan"
        )


def blocks_of(stage: nn.Module) -> list[nn.Module]:
    """The units of ``fsdp="reshard"`` in ``stage`` (the stage itself not included), the
    innermost first, as ``fully_shard`` needs them.

    A block is a module that runs by being called, so that FSDP's forward hooks gather
    it: each module the stage calls (a layer of a layer list, a step of an execution
    sequence, each module a graph split's graph calls) and, inside one, each element of a
    ``ModuleList`` / ``Sequential`` (nested blocks, each a unit inside its parent's). A
    block becomes a unit only when it holds parameters no inner unit holds, and none of
    them is also held by a module outside it or read by name by the stage's graph (a tied
    weight, a weight a traced function reads): those stay with the stage's own unit,
    which is gathered for the stage's whole forward. A graph split by torch.fx calls
    leaf modules (a transformer block's Linear and LayerNorm layers, not the block,
    which does not run as a module there); one captured with torch.export reads every
    weight by name, except the modules the capture keeps whole (expert collections, a
    tp_plan's projections: :mod:`conveyor.partition.kept`), which it calls.
    """
    holders: dict[int, set[int]] = {}
    for module in stage.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    read = _read_by_name(stage)
    out: list[nn.Module] = []
    claimed: set[int] = set()
    seen: set[int] = set()
    for called in called_modules(stage):
        for block in _innermost_first(called):
            if id(block) in seen or block is stage:
                continue
            seen.add(id(block))
            inside = {id(m) for m in block.modules()}
            own = [p for p in block.parameters() if id(p) not in claimed]
            if own and all(holders[id(p)] <= inside and id(p) not in read for p in own):
                out.append(block)
                claimed.update(id(p) for p in own)
    return out


def _innermost_first(module: nn.Module) -> list[nn.Module]:
    """``module`` and the ModuleList / Sequential elements nested in it, each after
    the elements nested in it."""
    out: list[nn.Module] = []

    def elements(m: nn.Module) -> list[nn.Module]:
        found: list[nn.Module] = []
        for child in m.children():
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                found.append(child)
            else:
                found += elements(child)
        return found

    for element in elements(module):
        out += _innermost_first(element)
    out.append(module)
    return out


def _read_by_name(stage: nn.Module) -> set[int]:
    """Parameters ``stage``'s graph reads by name (``get_attr``), not through a call."""
    from torch import fx

    if not isinstance(stage, fx.GraphModule):
        return set()
    out: set[int] = set()
    for n in stage.graph.nodes:
        if n.op == "get_attr":
            *prefix, field = str(n.target).split(".")
            value = getattr(stage.get_submodule(".".join(prefix)), field, None)
            if isinstance(value, nn.Parameter):
                out.add(id(value))
    return out


def _own_storage(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's outputs that are views (a Linear's on a 3-D input) as copies, before FSDP
    hooks its backward gather on them: an in-place op on a view (the next layer's
    ``ReLU(inplace=True)``) would drop that hook, and the backward would run on the
    sharded weights."""
    from torch.utils import _pytree as pytree

    def own(t: Any) -> Any:
        view = isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None
        return t.clone() if view else t

    return pytree.tree_map(own, output)


def _release_at_exit(stage: nn.Module) -> None:
    """Let go of the process groups that FSDP keeps in ``stage``'s units' mesh infos when
    conveyor's exit hook runs (``conveyor/_groups.py`` says why): the pipeline and the
    optimizer the user's script holds reach them until interpreter finalization."""
    from torch.distributed.fsdp import FSDPModule

    for module in stage.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_state.unit_param_groups(module):
                for info in (group.mesh_info, group.post_forward_mesh_info):
                    if info is not None:
                        on_release(info, _drop_groups)


def _drop_groups(mesh_info: Any) -> None:
    """An FSDP mesh info without its process groups (at exit)."""
    for name in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
        if hasattr(mesh_info, name):
            setattr(mesh_info, name, None)


class Sharded:
    """FSDP2 over the ``dp`` mesh dimension for this rank's stages, gathered and reduced
    by the schedule (see the module doc), and for units beside the stages."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        mesh: Any,
        per_action: bool = False,
        experts: tuple[list[nn.Module], Any, int] = ([], None, 1),
        beside: Mapping[int, nn.Module] | None = None,
    ) -> None:
        """``experts``: expert collections sharded over ep, with the mesh FSDP shards them
        over (the replicas holding the same experts) and the factor their gradients are
        divided by (the rest's: ``mesh``'s size). ``beside``: units (keys other than the
        stages') whose parameters the stage ends use without calling them (so FSDP's
        hooks never run): each one unit, gathered for a whole step."""
        from torch.distributed.fsdp import fully_shard

        self.stages = stages
        self.beside = dict(beside or {})
        self.units: dict[int, nn.Module] = {**stages, **self.beside}
        self.per_action = per_action
        collections, edp, divide = experts
        for module in collections:  # their own units first, as torchtitan does
            unit: Any = fully_shard(module, mesh=edp, reshard_after_forward=per_action)
            unit.set_gradient_divide_factor(float(divide))
            gloo = dist.get_backend(edp.get_group()) == "gloo"
            if edp.size() > 1 and divide != edp.size() and gloo:
                # FSDP reduces by another factor than its mesh's size with PREMUL_SUM,
                # which gloo lacks: a sum, then the division. (Over one rank there is no
                # reduction, and FSDP then divides by nothing: the sum path would divide.)
                unit.set_force_sum_reduction_for_comms(True)
        for stage in stages.values():
            if per_action:
                for block in blocks_of(stage):
                    fully_shard(block, mesh=mesh, reshard_after_forward=True)
                    block.register_forward_hook(_own_storage, prepend=True)
                fully_shard(stage, mesh=mesh, reshard_after_forward=True)
            else:
                fully_shard(stage, mesh=mesh, reshard_after_forward=False)
            _release_at_exit(stage)
        for module in self.beside.values():
            fully_shard(module, mesh=mesh, reshard_after_forward=False)
            _release_at_exit(module)
        self._pending: dict[int, Any] = {}

    def begin(self, order: list[int]) -> None:
        """Start gathering every unit of ``order`` (the stages in the order the schedule
        first uses them, then the units beside them)."""
        for s in order:
            stage: Any = self.units[s]
            per_action = self.per_action and s not in self.beside
            if s in self.beside:
                # Never called, so never made a root by a forward (after meta weights got
                # their values: not at construction); once, later calls return at once.
                fsdp_state.initialize(stage)
            stage.set_requires_gradient_sync(False, recurse=True)
            stage.set_is_last_backward(False)
            stage.set_reshard_after_backward(per_action, recurse=True)
            if not per_action:
                # The stage's own unit does not gather its sub-units (the expert
                # collections'): gathered now too, their gathered tensors are the ones
                # the split backward's W differentiates for (ShardedSync.gathered).
                units = [stage, *(m for m in stage.modules() if m is not stage
                                  and hasattr(m, "unshard"))]  # fmt: skip
                self._pending[s] = [unit.unshard(async_op=True) for unit in units]

    def ready(self, stage: int) -> None:
        """Wait for ``stage``'s gathers (call before its first action of the step)."""
        for handle in self._pending.pop(stage, []):
            if handle is not None:
                handle.wait()

    def release(self, stage: int, train: bool) -> None:
        """After ``stage``'s last action of the step: reduce-scatter its gradients over
        the replicas (training) and free the gathered parameters."""
        self.ready(stage)
        module: Any = self.units[stage]
        if train:
            module.set_requires_gradient_sync(True, recurse=True)
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True, recurse=True)
            fsdp_state.reduce_gradients(module)
        module.reshard()
        for sub in module.modules():
            if sub is not module and hasattr(sub, "reshard"):
                sub.reshard()


class ShardedSync(StepSync):
    """The schedule driving :class:`Sharded`: each stage gathered before its first action
    of a step (all started at the step's start, in first-use order) and reduced after
    its last; ``gathered(stage)`` is told when a stage's gathered tensors are in place.
    The units beside the stages are gathered after them at the step's start, waited for
    before the first pass of the stage ends, and reduced at the step's end."""

    def __init__(self, sharded: Sharded, gathered: Callable[[int], None]) -> None:
        self.sharded = sharded
        self.gathered = gathered
        self._program: RankProgram | None = None  # the step's
        self._sharded: set[int] = set()  # ids of the units' sharded parameters

    def begin(self, program: RankProgram) -> None:
        self._program = program
        beside = self.sharded.beside
        self._sharded = {id(p) for unit in beside.values() for p in unit.parameters()}
        self.sharded.begin(sorted(program.first, key=program.first.__getitem__) + list(beside))

    def before_action(self, action: Action) -> None:
        assert self._program is not None
        stage = self._program.opening.get(action)
        if stage is not None:
            self.sharded.ready(stage)
            self.gathered(stage)

    def before_pass(self) -> None:
        for unit in self.sharded.beside:
            self.sharded.ready(unit)  # only the first pass waits

    def after_action(self, action: Action) -> None:
        assert self._program is not None
        stage = self._program.closing.get(action)
        if stage is not None:
            self.sharded.release(stage, self._program.train)

    def finish(self) -> None:
        assert self._program is not None
        for unit in self.sharded.beside:
            self.sharded.release(unit, self._program.train)

    def abort(self) -> None:
        """A failed step: the partial gradients on the units' gathered parameters are
        dropped (no collective: the replicas may have stopped at different points); the
        sharded ones, the earlier steps', are kept."""
        for unit in self.sharded.beside.values():
            for module in unit.modules():
                for p in module.parameters(recurse=False):
                    if id(p) not in self._sharded:
                        p.grad = None
