"""Every rule between :class:`conveyor.Pipeline`'s keywords (and ``conveyor.init``'s,
which the context carries), in one place.

:data:`RULES` lists them as the reference page's table shows them (a test holds the two
equal). Each rule is checked where its facts are first known: the keywords alone and the
context before anything runs (:func:`check_context`), the schedule once it is built
(:func:`check_schedule`), the split model while it is built (``_build.py`` calls the
rules about it from here), a step's batch when it comes. Rules whose facts belong to
another part name the function that checks them there (``checked_by``).

A keyword's own values (``microbatches`` an int >= 1, ``fsdp`` one of three values, ...)
are checked by :class:`~conveyor._options.Options` at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from conveyor.errors import ConfigError
from conveyor.runtime.recompute import recompute_stages
from conveyor.schedules import Schedule

if TYPE_CHECKING:
    from torch import nn

    from conveyor.context import Context


class Options(Protocol):
    """What the rules read of :class:`~conveyor._options.Options` (a protocol, so this
    module stays below the one that calls it)."""

    @property
    def fsdp(self) -> bool | str: ...

    @property
    def tp_plan(self) -> Mapping[str, Any] | str | None: ...

    @property
    def recompute(self) -> bool | Iterable[int]: ...

    def compile_keywords(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class Rule:
    """One rule between keywords.

    Attributes:
        keywords: the keywords it relates: ``Pipeline``'s, ``init(dp)``-style for
            ``conveyor.init``'s, ``the model`` for what the model is.
        says: the rule in words (the docs table's second column).
        checked_by: the qualified name of the function that checks it.
    """

    keywords: tuple[str, ...]
    says: str
    checked_by: str


RULES: list[Rule] = []
"""Every cross-rule, in the order a user meets them."""

F = TypeVar("F", bound=Callable[..., None])


def _rule(*keywords: str, says: str) -> Callable[[F], F]:
    """Register the decorated check as the rule ``says`` between ``keywords``."""

    def register(check: F) -> F:
        RULES.append(Rule(keywords, says, f"{check.__module__}.{check.__qualname__}"))
        return check

    return register


def _elsewhere(*keywords: str, says: str, checked_by: str) -> None:
    """Register a rule that another part checks (its facts live there)."""
    RULES.append(Rule(keywords, says, checked_by))


# ---------------------------------------------------------------- the keywords and context
@_rule("memory_limit", "schedule", says="memory_limit is given only with schedule='auto'")
def memory_limit_needs_auto(schedule: Any, memory_limit: float | None) -> None:
    """The planner reads ``memory_limit``; any other schedule would ignore it."""
    if memory_limit is not None and schedule != "auto":
        raise ConfigError(
            f"memory_limit is what schedule='auto' plans for; with schedule="
            f"{getattr(schedule, 'name', schedule)!r} nothing reads it: pass "
            f"schedule='auto', or leave memory_limit out"
        )


@_rule("schedule", "sample", says="schedule='auto' needs sample=(inputs, targets)")
def auto_needs_sample(schedule: Any, sample: Any) -> None:
    """The planner profiles the model on a batch."""
    if schedule == "auto" and sample is None:
        raise ConfigError(
            "schedule='auto' profiles the model on a batch: pass sample=(inputs, targets), "
            "e.g. your first batch"
        )


@_rule("fsdp", "init(dp)", says="fsdp needs conveyor.init(dp=D) on P x D processes, D >= 2")
def fsdp_needs_replicas(options: Options, ctx: Context) -> None:
    """FSDP shards over the data-parallel replicas (and the context-parallel ranks)."""
    if options.fsdp and (not ctx.distributed or ctx.replicas < 2):
        raise ConfigError(
            "fsdp=True shards over the data-parallel replicas; start them with "
            "conveyor.init(pp=P, dp=D) on P x D processes, D >= 2"
        )


@_rule("tp_plan", "init(tp)", says="tp_plan needs conveyor.init(tp=T) on P x T processes, T >= 2")
def tp_plan_needs_tp_ranks(options: Options, ctx: Context) -> None:
    """Tensor parallelism shards over the tensor-parallel ranks."""
    if options.tp_plan is not None and (not ctx.distributed or ctx.tp_size < 2):
        raise ConfigError(
            "tp_plan shards layers over tensor-parallel ranks; start them with "
            "conveyor.init(pp=P, tp=T) on P x T processes, T >= 2"
        )


@_rule("compile", "tp_plan", says="compile with tp_plan needs compile={'dynamic': False}")
def compile_static_with_tp(options: Options, ctx: Context) -> None:
    """Tensor-parallel (DTensor) stages compile with static shapes only."""
    keywords = options.compile_keywords()
    dynamic = keywords is not None and keywords.get("dynamic") is not False
    if options.tp_plan is not None and dynamic:
        raise ConfigError(
            "compile with tp_plan needs static shapes: tracing tensor-parallel (DTensor) "
            "stages with dynamic shapes fails in AOTAutograd (RecursionError); pass "
            "compile={'dynamic': False} (each new sequence length then compiles once), or "
            "compile=False"
        )


CONTEXT_RULES = (fsdp_needs_replicas, tp_plan_needs_tp_ranks, compile_static_with_tp)


def check_context(options: Options, ctx: Context) -> None:
    """The rules between the keywords and the processes ``ctx`` describes.

    Raises:
        ConfigError: the first rule broken, in its own sentence.
    """
    for check in CONTEXT_RULES:
        check(options, ctx)


@_rule(
    "balance",
    "chunks",
    "init(pp)",
    says="a launched run's balance has pp x chunks entries, one per stage",
)
def balance_fits_launch(ctx: Context, balance: Any, chunks: int) -> None:
    """A balance for another stage count than pp x chunks of a launched run, in words
    that say how many processes it needs (one process runs as many ranks as it says)."""
    if not isinstance(balance, (list, tuple)) or len(balance) == ctx.pp_size * chunks:
        return
    stages, have = len(balance), ctx.pp_size * chunks
    head = (
        f"balance {list(balance)} describes {stages} stages, but this run has {ctx.pp_size} "
        f"pipeline ranks x {chunks} chunk(s) = {have} stages"
    )
    if stages % chunks:
        raise ConfigError(f"{head}; give balance {have} entries, one layer count per stage")
    ranks = stages // chunks
    need = ranks * ctx.dp_size * ctx.cp_size * ctx.tp_size
    cp = f" x cp {ctx.cp_size}" if ctx.cp_size > 1 else ""
    mesh = f" x dp {ctx.dp_size}{cp} x tp {ctx.tp_size}" if need != ranks else ""
    raise ConfigError(
        f"{head}; launch {need} processes for {ranks} pipeline ranks{mesh} (conveyor launch "
        f"--nproc-per-node {need} script.py), or give balance {have} entries"
    )


@_rule(
    "balance",
    "chunks",
    "the model",
    says="in one process, the stages balance or annotations describe are a multiple of chunks",
)
def stages_share_out(stages: int, chunks: int, by_balance: bool) -> None:
    """Each pipeline rank runs ``chunks`` stages."""
    if stages % chunks:
        where = "balance" if by_balance else "the pipeline_stage annotations"
        raise ConfigError(
            f"{where} describe {stages} stages, which {chunks} chunks per rank cannot "
            f"share out; give a multiple of {chunks} stages"
        )


# ---------------------------------------------------------------- the schedule
_elsewhere(
    "schedule",
    "chunks",
    says="a named schedule runs the chunk counts it supports",
    checked_by="conveyor.schedules.registry.check_chunks",
)


@_rule(
    "schedule",
    "microbatches",
    "chunks",
    "init(pp)",
    says="a given Schedule is built for the pipeline's ranks, microbatches and chunks",
)
def schedule_fits(schedule: Schedule, ranks: int, microbatches: int, chunks: int | None) -> None:
    """A :class:`~conveyor.schedules.Schedule` given as such runs as built."""
    if schedule.ranks != ranks or schedule.microbatches != microbatches:
        raise ConfigError(
            f"schedule {schedule.name!r} is for {schedule.ranks} ranks and "
            f"{schedule.microbatches} micro-batches, but the pipeline has {ranks} ranks and "
            f"microbatches={microbatches}; build the schedule for the same numbers"
        )
    if chunks is not None and chunks != schedule.chunks:
        raise ConfigError(
            f"schedule {schedule.name!r} runs {schedule.chunks} chunk(s) per rank, but "
            f"chunks={chunks}; leave chunks out (a given schedule has its own) or build the "
            f"schedule with {chunks}"
        )


@_rule(
    "recompute",
    "schedule",
    "chunks",
    says="recompute names global stage indices 0 .. pp x chunks - 1",
)
def recompute_in_stages(options: Options, schedule: Schedule) -> None:
    """Stage indices the schedule has."""
    recompute_stages(options.recompute, schedule.stages)


SCHEDULE_RULES = (recompute_in_stages,)


def check_schedule(options: Options, schedule: Schedule) -> None:
    """The rules between the keywords and the schedule the pipeline runs.

    Raises:
        ConfigError: the first rule broken, in its own sentence.
    """
    for check in SCHEDULE_RULES:
        check(options, schedule)


# ---------------------------------------------------------------- the split model
@_rule(
    "fsdp",
    "schedule",
    "the model",
    says="fsdp needs no weight tied between two stages of one rank (a V schedule)",
)
def ties_for_fsdp(ties: list[tuple[dict[int, str], list[int]]], placement: tuple[int, ...]) -> None:
    """FSDP shards each stage on its own: a weight two stages of one rank share would
    become two. Checked over every rank's stages (every rank knows the whole placement),
    so every rank raises the same error instead of only those holding the weight."""
    for names, holders in ties:
        for rank in sorted({placement[s] for s in holders}):
            local = [s for s in holders if placement[s] == rank]
            if len(local) > 1:
                raise ConfigError(
                    f"fsdp cannot shard the weight {names[local[0]]!r}, which stages "
                    f"{local[0]} and {local[1]} of pipeline rank {rank} share (a V schedule "
                    f"with tied weights); use a schedule that places stages in a loop "
                    f"(1f1b, zb-h1, interleaved-1f1b) or untie the weight"
                )


@_rule(
    "balance",
    "schedule",
    "the model",
    says="an automatic split (no balance, no annotations) gives every rank parameters",
)
def every_rank_trains(schedule: Schedule, all_stages: list[nn.Module]) -> None:
    """An automatic split must give every rank parameters (an optimizer over none fails);
    the balance does so whenever the model has enough layers with parameters."""
    if not any(p.requires_grad for stage in all_stages for p in stage.parameters()):
        return
    for rank in range(schedule.ranks):
        held = schedule.stages_of(rank)
        if not any(p.requires_grad for s in held for p in all_stages[s].parameters()):
            raise ConfigError(
                f"the automatic split leaves pipeline rank {rank} (stages "
                f"{', '.join(map(str, held))}) without parameters: the model has too few "
                f"layers with parameters for {schedule.stages} stages; use fewer ranks or "
                f"chunks, or say where to cut with balance= or pipeline_stage annotations"
            )


_elsewhere(
    "tp_plan",
    "ep_plan",
    "init(ep)",
    says="with ep > 1, tp_plan matches no expert collection ep shards",
    checked_by="conveyor.experts.shard.check_tp_plan",
)
_elsewhere(
    "ep_plan",
    "init(ep)",
    says="ep divides each chosen collection's expert count",
    checked_by="conveyor.experts.shard.check_divisible",
)
_elsewhere(
    "tp_plan",
    "the model",
    says="on a model torch.export captures, tp_plan gives ColwiseParallel / "
    "RowwiseParallel to nn.Linear / nn.Embedding only",
    checked_by="conveyor.runtime.tp_export.check_export_plan",
)
_elsewhere(
    "vocab_parallel",
    "loss_fn",
    says="vocab_parallel takes a TokenCrossEntropy loss_fn, or loss_fn=None on a "
    "transformers causal LM",
    checked_by="conveyor.vocab.setup.vocab_loss",
)

# ---------------------------------------------------------------- a step's batch
_elsewhere(
    "loss_fn",
    "train_step(targets)",
    says="loss_fn=None takes no targets: the labels go inside the inputs",
    checked_by="conveyor._options.check_step",
)
