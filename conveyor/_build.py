"""Building what one process runs: its stages of the split model, tied weights, replicas,
tensor and FSDP sharding, and the engine that runs them.

:func:`build` returns a :class:`RankParts`; :class:`conveyor.Pipeline` keeps one, and the
planner builds its own to time real steps. A model only ``torch.export`` can capture is
split on a sample (:func:`conveyor.runtime.microbatch.first`); :func:`shared_sample`
hands the first stage's to every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor._ends import HOLDER, Ends, stage_ends
from conveyor._options import Options
from conveyor._rules import every_rank_trains, ties_for_fsdp
from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.experts import apply_ep, check_tp_plan, chosen
from conveyor.partition import shared_parameters, split_model
from conveyor.partition.annotations import annotated_stages
from conveyor.partition.describe import SplitInfo, describe_split
from conveyor.partition.owned import Modes, own_modules
from conveyor.partition.replaced import record
from conveyor.partition.resplit import Before, adopt, check_moves
from conveyor.runtime import microbatch
from conveyor.runtime.compiled import CompileStats, compile_stages
from conveyor.runtime.data_parallel import DataParallel, make_replicas_equal
from conveyor.runtime.engine import Engine
from conveyor.runtime.sharding import Sharded, ShardedSync, apply_tp
from conveyor.runtime.shared import SharedParameters
from conveyor.runtime.step import Stepper
from conveyor.runtime.step_grads import StepGradients
from conveyor.runtime.step_sync import StepSync
from conveyor.runtime.tp_export import check_export_plan, kept_for_tp
from conveyor.runtime.tp_styles import resolve
from conveyor.runtime.transport import guarded
from conveyor.schedules import Schedule
from conveyor.weights import Pending, has_meta
from conveyor.weights.allocate import allocate_sharded


@dataclass(frozen=True)
class RankParts:
    """What this process runs of a pipeline.

    Attributes:
        stages: global stage index -> module, for the stages this process holds.
        description: the whole split, as ``print(pipe)`` shows it.
        shared: weights tied across stages, with the groups that sum their gradients.
        stepper: runs this process's steps (:class:`~conveyor.runtime.step.Stepper`).
        ends: the stage ends (:class:`~conveyor._ends.Ends`: their unit beside the stages).
        modes: the user's modules the stages hold copies of (their modes followed).
    """

    stages: dict[int, nn.Module]
    description: SplitInfo
    shared: SharedParameters
    stepper: Stepper
    ends: Ends
    modes: Modes = field(default_factory=Modes)

    @property
    def compiled(self) -> CompileStats | None:
        """Compiled stages' graphs and compile time (None: eager stages)."""
        return self.stepper.engine.compute.compiled

    def compile_note(self) -> str:
        """Lines for ``print(pipe)``: per stage held here, what compiling it cost."""
        compiled = self.compiled
        if compiled is None:
            return ""
        return "".join(f"\n  stage {s} {compiled.describe(s)}" for s in sorted(self.stages))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The stages' parameters by their names in the model, a tied one once."""
        return _named(self._modules())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stages' buffers by their names in the model, each once."""
        seen: set[int] = set()
        for module in self._modules():
            for name, b in module.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    yield name, b

    def _modules(self) -> list[nn.Module]:
        """The stages in order, then the unit of the stage ends (if they have one)."""
        held = [self.stages[s] for s in sorted(self.stages)]
        holder = self.ends.holder
        return held + ([holder] if holder is not None else [])

    def state_dict(self) -> dict[str, Any]:
        """The stages' state, keyed by the names in the model."""
        out: dict[str, Any] = {}
        for module in self._modules():
            out.update(module.state_dict())
        return out

    def load_state_dict(self, state: Mapping[str, Any], strict: bool) -> None:
        """Load the stages' entries of ``state``, ignoring other keys.

        Raises:
            ConfigError: ``strict`` and keys of these stages are missing.
        """
        missing: list[str] = []
        for module in self._modules():
            own = module.state_dict()
            missing += [k for k in own if k not in state]
            module.load_state_dict({k: state[k] for k in own if k in state}, strict=False)
        if strict and missing:
            raise ConfigError(
                f"state dict lacks {len(missing)} keys this rank needs, e.g. {missing[:3]}; "
                f"pass the model's full state dict or strict=False"
            )


def _named(modules: Iterable[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of ``modules`` by their names in the model, a tied one once."""
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def held_stages(schedule: Schedule, ctx: Context) -> tuple[int, ...]:
    """The global indices of the stages this process runs: its rank's, or every stage in
    a one-process world."""
    if ctx.distributed:
        return tuple(sorted(schedule.stages_of(ctx.pp_rank)))
    return tuple(range(schedule.stages))


def build(
    model: nn.Module,
    schedule: Schedule,
    options: Options,
    ctx: Context,
    sample: Any,
    check: Callable[[list[tuple[str, nn.Parameter]]], None] | None = None,
) -> RankParts:
    """Split ``model`` and set up this process's share of the pipeline.

    Args:
        model: the whole model, built the same on every rank.
        schedule: the schedule (its placement says which rank holds which stage).
        options: the pipeline's checked options.
        ctx: the process's context.
        sample: a first micro-batch of inputs for a graph capture, or None.
        check: told this process's parameters (by their names in the model) once the
            split is known, before any value is written to one (made equal over replicas
            or ties, given, sharded); it may raise.

    Returns:
        This process's :class:`RankParts`.

    Raises:
        NeedsSample: the model needs ``torch.export`` and ``sample`` is None.
        ConfigError: a split or sharding that cannot work, in one sentence.
    """
    # What the first stage reads and the last stage's output becomes (the model's own
    # input and loss, or other ends that may hold parameters beside the stages).
    ends = stage_ends(model, options, ctx, schedule)
    sample = ends.sample(sample) if sample is not None else None
    tp_plan = resolve(options.tp_plan, model)  # "auto": the model's own plan
    kept = kept_for_tp(ends.model, tp_plan, ctx.tp_size)  # run as modules under torch.export
    all_stages = split_model(ends.model, schedule.stages, options.balance, sample,
                             schedule.placement, kept)  # fmt: skip
    ends.split(all_stages)
    if options.balance is None and annotated_stages(model) is None:
        every_rank_trains(schedule, all_stages)
    held = held_stages(schedule, ctx)
    # Meta tensors (conveyor.empty_weights) get values only where they are held, after
    # any sharding: a rank allocates its own stages (under FSDP, its own shards).
    # Decided on the whole model, so that every rank takes the same collectives below.
    meta = has_meta(all_stages)
    stages: dict[int, nn.Module] = {s: _to_device(all_stages[s], ctx.device) for s in held}
    # What the build changes on modules (sharding, compiling) lands on the stages' own
    # copies of the user's modules: the model keeps its modules as they were.
    modes = own_modules(stages.values(), model)
    sharding = options.tp_plan is not None or bool(options.fsdp) or ctx.ep_size > 1
    given = meta or options.weights is not None
    # The ends' unit is one more beside the stages (initialized, reduced, sharded alike).
    units = stages if ends.holder is None else {**stages, HOLDER: ends.holder}
    own = list(units.values())
    if check is not None:
        check(list(_named(own)))
    pending = Pending(model, own, options.weights, options.init_seed) if given else None
    # Tied weights on several ranks: copies start equal and their gradients are summed.
    # Found by identity, so before any value is given (giving a meta parameter its value
    # makes a new object on this rank, while other ranks' stages keep the meta one).
    ties = [
        ({s: _name_of(all_stages[s], all_stages[group[0]], name) for s in group}, group)
        for name, group in shared_parameters(all_stages)
    ]
    if pending is not None and not sharding:
        pending.give(ctx.device)
    description = describe_split(model, all_stages, schedule.placement)

    shared = SharedParameters(ties, schedule.placement, stages, ctx)
    # Values given by conveyor are equal on every rank by construction (seeded by name, or
    # read from one checkpoint); the real parameters of a partly meta model must be built
    # the same on every rank.
    if not given:
        shared.make_equal()
    # Data-parallel replicas start from replica 0's parameters (before any sharding).
    replicas = ctx.distributed and ctx.replicas > 1
    if replicas and not given:
        make_replicas_equal(units, ctx)
    # Expert collections over the ep ranks: each rank keeps its experts' share (values
    # given later land in that share), before tensor parallelism as in torchtitan.
    experts = apply_ep(stages, options.ep_plan, ctx, every=all_stages)
    sharded = None
    if tp_plan is not None:
        assert ctx.mesh is not None
        if ctx.ep_size > 1:
            every = [n for n, _ in chosen(all_stages, options.ep_plan)]
            check_tp_plan(tp_plan, every, [n for n, _ in model.named_modules()])
        if description.method == "export":
            check_export_plan(model, tp_plan, kept)
        names = [n for n, _ in model.named_modules()] if isinstance(model, nn.Module) else []
        apply_tp(stages, tp_plan, names, ctx.mesh["tp"], every=all_stages)
    keywords = options.compile_keywords()
    # torchtitan's order: tensor parallel, then compile (inside each FSDP unit), then FSDP.
    compiled = None if keywords is None else compile_stages(stages, keywords)
    if options.fsdp:
        assert ctx.mesh is not None
        ties_for_fsdp(ties, schedule.placement)
        sharded = Sharded(
            stages, ctx.replica_mesh, per_action=options.fsdp == "reshard",
            experts=_experts_fsdp(stages, experts, ctx),
            beside={k: v for k, v in units.items() if k not in stages},
        )  # fmt: skip
    if pending is not None and sharding:
        owned = meta and bool(options.fsdp)  # FSDP allocates its shards' storage itself
        allocate = (lambda: allocate_sharded(own, ctx.device)) if owned else None
        pending.give(ctx.device, allocate)
    if sharding:
        shared.rebind(stages)
    engine = Engine(
        schedule,
        stages,
        ends.runtime,
        ctx,
        recompute=options.recompute_stages(schedule.stages),
        autocast=options.autocast,
        track_memory=options.track_memory,
        compiled=compiled,
        modules={s: ", ".join(description.stages[s].modules) for s in held},
        # Every pipeline rank decides alike (the pairs shape every rank's program): the
        # model has expert collections and they are spread over ep ranks.
        pairs=ctx.ep_size > 1 and bool(chosen(all_stages, options.ep_plan)),
    )
    # Without FSDP, replicas average their gradients while the pipeline drains.
    reductions: list[StepSync] = []
    if replicas and not options.fsdp:
        reductions.append(DataParallel(units, ctx))
    if shared:
        reductions.append(shared)
    gathers: list[StepSync] = (
        [] if sharded is None else [ShardedSync(sharded, engine.compute.gathered)]
    )
    gathers += ends.syncs
    params = [p for unit in units.values() for p in unit.parameters()]
    stepper = Stepper(
        engine,
        ctx,
        reads_targets=options.loss_fn is not None,
        counter=ends.counter,
        reductions=reductions,
        gathers=gathers,
        grads=StepGradients(params),
        fsdp_replicas=ctx.replicas if options.fsdp else 1,
    )
    return RankParts(stages, description, shared, stepper, ends, modes)


def build_over(
    model: nn.Module,
    schedule: Schedule,
    options: Options,
    ctx: Context,
    sample: Any,
    before: Before | None,
    originals: Mapping[str, torch.Tensor],
) -> RankParts:
    """:func:`build` for a :class:`~conveyor.Pipeline` over the user's ``model``: a split
    that would move trained values between processes is refused before any value is
    written (``before``: what :func:`~conveyor.partition.resplit.make_whole` found); then
    the model is pointed at this rank's parameters and buffers, and each of its parameter
    objects (``originals``, before the pipeline) that the split replaced is noted, for
    optimizers built over them (:mod:`conveyor.partition.replaced`)."""
    check = functools.partial(check_moves, model, ctx=ctx, before=before)
    parts = build(model, schedule, options, ctx, sample, check=check)
    adopt(model, parts.named_parameters(), parts.named_buffers())
    record(originals, model)
    return parts


def shared_sample(ctx: Context, schedule: Schedule, microbatches: int, inputs: Any) -> Any:
    """The sample every rank captures the model on: the first micro-batch of the inputs
    the rank holding stage 0 was given (other ranks may pass ``inputs=None``).

    Raises:
        ConfigError: that rank got no inputs, or a bad batch (raised on every rank).
    """
    if not ctx.distributed:
        sample = None if inputs is None else microbatch.first(inputs, microbatches)
    else:
        holder = ctx.global_rank(schedule.placement[0])
        box: list[Any] = [None]
        if ctx.rank == holder and inputs is not None:
            try:  # a bad batch is sent as its error, so that every rank raises it
                first = microbatch.first(inputs, microbatches)
                box = [microbatch.to_device(first, torch.device("cpu"))]
            except ConfigError as error:
                box = [error]
        guarded(
            lambda: dist.broadcast_object_list(box, src=holder, group=ctx.pp_group),
            f"rank {ctx.rank}: receiving the first batch from rank {holder} (the model is "
            f"captured on it)",
            f"rank {holder}",
        )
        sample = box[0]
        if isinstance(sample, ConfigError):
            raise sample
    if sample is None:
        raise ConfigError(
            "this model is captured with torch.export on its first batch, but the first "
            "step got inputs=None; pass the batch, or Pipeline(..., sample=(inputs, targets))"
        )
    return sample


def _experts_fsdp(
    stages: dict[int, nn.Module], experts: list[str], ctx: Context
) -> tuple[list[nn.Module], Any, int]:
    """What FSDP shards of the expert collections (torchtitan's way): the collections,
    over the replicas holding the same experts (``mesh["edp"]``), their gradients divided
    as the rest's (by ``dp``, which the loss scale undoes)."""
    if not experts:
        return [], None, 1
    assert ctx.mesh is not None
    modules = [
        m for stage in stages.values() for n, m in stage.named_modules() if n in set(experts)
    ]
    mesh = ctx.mesh["edp_cp"] if ctx.cp_size > 1 else ctx.mesh["edp"]
    return modules, mesh, ctx.replicas


def _to_device(stage: nn.Module, device: torch.device) -> nn.Module:
    """``stage`` with its real tensors on ``device``; meta ones stay (they get values later)."""
    moved: nn.Module = stage._apply(  # type: ignore[no-untyped-call]
        lambda t: t if t.is_meta else t.to(device)
    )
    return moved


def _name_of(stage: nn.Module, first: nn.Module, name: str) -> str:
    """The name ``stage`` uses for the parameter ``first`` holds as ``name``."""
    param = dict(first.named_parameters())[name]
    return next(n for n, p in stage.named_parameters() if p is param)
