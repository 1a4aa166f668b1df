"""What conveyor posts cannot deadlock under NCCL's rules, for every schedule and layout.

Each test runs real gloo processes that record every operation they post at the
``torch.distributed`` level (``tests/support/nccl_record.py``), for every schedule (with
replicas or tensor parallelism, one of each family: ``FAMILIES``) on three models
(an MLP, a graph-split model whose skip connection crosses every stage boundary
(``conveyor.verify.SkipNet``), and the
GPT example with its tied embedding), through construction, two training steps with
different shapes, an ``eval_step`` and a ``predict``. The parent replays each rank's
record under NCCL's rules (``tests/support/nccl_model.py``: order matching without tags, one
stream per communicator, blocking or buffered sends, per-pair or per-rank streams) and
fails with the deadlock's ranks, operations and posting lines.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.losses import TokenCrossEntropy
from conveyor.schedules import SCHEDULE_NAMES, default_chunks
from conveyor.verify import Block, SkipNet
from tests.support import distributed
from tests.support.nccl_model import Record, check
from tests.support.nccl_record import recording
from tests.support.trainer_forked import run_forked

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402  (examples/gpt.py: the GPT example, tied head, tensor-parallel plan)

MODELS = ("plain", "skips", "tied", "meta")
# The GPT built on the meta device (conveyor.empty_weights): construction posts no
# broadcast of ties and replicas (every rank gives the same values); a few schedules.
META_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    # FSDP2 warns that a graph-split stage returns a view; conveyor keeps stages gathered
    # through the step (no pre-backward unshard is needed), so the warning does not apply.
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]


def _model(kind: str, stages: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        return nn.Sequential(nn.Linear(8, 8), *[Block(8) for _ in range(8)], nn.Linear(8, 4))
    if kind == "skips":
        return SkipNet(depth=8, width=8, inputs=8, outputs=4)
    if kind == "meta":
        with conveyor.empty_weights():
            model = gpt.GPT(vocab=11, context=8, width=16, depth=8, heads=4)
        gpt.annotate(model, stages)
        return model
    model = gpt.GPT(vocab=11, context=8, width=16, depth=8, heads=4)
    gpt.annotate(model, stages)
    return model


def _plan(kind: str) -> dict[str, Any]:
    if kind in ("tied", "meta"):
        return gpt.tp_plan()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}


def _data(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if kind not in ("tied", "meta"):
        return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    ids = torch.randint(0, 11, (n, 8 - step), generator=g)  # the sequence shortens
    targets = ids[:, 1:].clone()
    targets[::2, 2:] = -100  # padded rows: the pair loss's counts differ per micro-batch
    return ids[:, :-1], targets


def _loss(kind: str) -> Any:
    # The GPT's token loss is a pair: its counts travel in the step's last collective.
    return TokenCrossEntropy() if kind in ("tied", "meta") else nn.functional.mse_loss


# Replicas and tensor parallelism run the pipeline-only layouts' programs; what they add
# (reductions after a stage's last action, FSDP's gathers, tensor-parallel collectives in
# every action) depends on a schedule's family: one of each (plain, all-forwards-first,
# interleaved, split backward, every W last, V, V with pairs, controllable-memory V).
FAMILIES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-late", "zbv", "dualpipev", "v-half")


def _record_all(rank: int, pp: int, dp: int, tp: int, fsdp: bool) -> dict[str, Any]:
    """Every schedule (with replicas or tensor parallelism, one of each family) and model
    on this process; returns each run's record (or the construction error, for the
    combinations conveyor refuses)."""
    ctx = conveyor.init(pp=pp, dp=dp, tp=tp, timeout=60)
    microbatches = 2 * pp
    out: dict[str, Any] = {}
    for name in SCHEDULE_NAMES if dp == tp == 1 else FAMILIES:
        chunks = default_chunks(name)
        for kind in MODELS:
            if kind == "meta" and name not in META_SCHEDULES:
                continue
            with recording(functional=tp > 1) as trace:
                try:
                    pipe = conveyor.Pipeline(
                        _model(kind, pp * chunks),
                        loss_fn=_loss(kind),
                        microbatches=microbatches,
                        schedule=name,
                        chunks=chunks,
                        context=ctx,
                        fsdp=fsdp,
                        tp_plan=_plan(kind) if tp > 1 else None,
                    )
                except conveyor.ConfigError as exc:
                    out[f"{name} {kind}"] = str(exc)
                    continue
                # New shapes, other shapes, then (in the pipeline-only layouts: replicas
                # and tensor parallelism run the same programs) those again: the second
                # step of a shape runs the program whose receives join earlier groups
                # (rule 4).
                again = 2 if dp == tp == 1 else 1
                sizes = (4 * microbatches,) + (2 * microbatches + 1,) * again
                for step, n in enumerate(sizes):
                    x, y = _data(kind, step, n)
                    mine = slice(ctx.dp_rank, None, dp)
                    pipe.train_step(x[mine], y[mine])
                x, y = _data(kind, 0, 2 * microbatches)
                for _ in range(again):
                    pipe.eval_step(x, y)
                pipe.predict(x)
            out[f"{name} {kind}"] = [r.to_dict() for r in trace]
    return out


LAYOUTS = {
    "pp2": (2, 1, 1, False),
    "pp4": (4, 1, 1, False),
    "pp2 x dp2": (2, 2, 1, False),
    "pp2 x dp2 fsdp": (2, 2, 1, True),
    "pp2 x tp2": (2, 1, 2, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_schedule_and_model_is_deadlock_free_under_nccl_rules(layout: str) -> None:
    pp, dp, tp, fsdp = LAYOUTS[layout]
    results = run_forked(_record_all, pp * dp * tp, pp, dp, tp, fsdp, timeout=600)
    refused = []
    for key in results[0]:
        runs = [r[key] for r in results]
        if isinstance(runs[0], str):
            # Only FSDP of a weight tied within one rank (V placements) is refused, and
            # every rank refuses it alike (none goes on to wait for the others).
            assert fsdp and key.endswith(("tied", "meta")), (key, runs[0])
            assert "V schedule" in runs[0], (key, runs[0])
            assert all(r == runs[0] for r in runs), (key, runs)
            refused.append(key)
            continue
        traces = {rank: [Record.from_dict(r) for r in run] for rank, run in enumerate(runs)}
        assert all(len(t) > 0 for t in traces.values()), key
        try:
            check(traces)
        except AssertionError as exc:
            raise AssertionError(f"{layout}, {key}:\n{exc}") from None
    # zbv, dualpipev, v-half, v-min with the tied GPT, and zbv with the meta one
    assert len(refused) <= 5, refused


def _record_compiled(rank: int, pp: int) -> dict[str, Any]:
    """Compiled stages (``compile=``, dynamo + AOTAutograd graphs) and eager ones on the
    tiny MLP, per schedule family (plain, split backward, V): each run's record."""
    ctx = conveyor.init(pp=pp, timeout=60)
    out: dict[str, Any] = {}
    for name in ("1f1b", "zb-h1", "dualpipev"):
        chunks = default_chunks(name)
        for mode in ("eager", "compiled"):
            with recording(functional=False) as trace:
                pipe = conveyor.Pipeline(
                    _model("plain", pp * chunks),
                    loss_fn=_loss("plain"),
                    microbatches=2 * pp,
                    schedule=name,
                    chunks=chunks,
                    context=ctx,
                    compile={"backend": "aot_eager"} if mode == "compiled" else False,
                )
                for step, n in enumerate((8 * pp, 4 * pp + 1)):
                    pipe.train_step(*_data("plain", step, n))
            out[f"{name} {mode}"] = [r.to_dict() for r in trace]
    return out


def _posted(run: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["kind"], r["name"], r["peer"], r["group"], r["shape"]) for r in run]


def test_compiled_stages_post_what_eager_ones_do() -> None:
    """Compiled code adds and reorders no collective or transfer: every rank posts what
    eager stages post, which replays without deadlock under NCCL's rules."""
    results = distributed.run(_record_compiled, 2, 2, timeout=600)
    for key in [k for k in results[0] if k.endswith("compiled")]:
        eager = key.replace("compiled", "eager")
        traces = {rank: [Record.from_dict(r) for r in res[key]] for rank, res in enumerate(results)}
        assert all(len(t) > 0 for t in traces.values()), key
        for res in results:
            assert _posted(res[key]) == _posted(res[eager]), key
        check(traces)


def _record_repeated(rank: int) -> dict[str, Any]:
    """1F1B on 2 ranks, two training steps of the same shapes: the second walks the
    program with every description known (rules 4 and 7); its record."""
    ctx = conveyor.init(pp=2, timeout=60)
    pipe = conveyor.Pipeline(
        _model("plain", 2), loss_fn=_loss("plain"), microbatches=8, context=ctx
    )
    x, y = _data("plain", 0, 16)
    pipe.train_step(x, y)
    with recording(functional=False) as trace:
        pipe.train_step(x, y)
    return {"trace": [r.to_dict() for r in trace]}


def test_the_engine_posts_receives_ahead_where_the_program_says() -> None:
    """What the engine really posts in a step whose descriptions are known is its
    program's groups, in order, between the step's header and its loss sums: a tick
    ``ahead`` posts its receives alone and then, after the compute, its sends (rule 7
    sends 1F1B's last rank ahead at each exchange, and rule 4 joins those receives to the
    group it posted after its previous B), every group lists its sends before its
    receives, and the whole replays under NCCL's rules."""
    from conveyor.runtime.program import ahead_ranks, rank_program
    from conveyor.schedules import get_schedule

    results = distributed.run(_record_repeated, 2, timeout=300)
    traces = {r: [Record.from_dict(x) for x in res["trace"]] for r, res in enumerate(results)}
    check(traces)
    schedule = get_schedule("1f1b", 2, 8)
    assert sum(len(ranks) for ranks in ahead_ranks(schedule).values()) == 6
    for rank, records in traces.items():
        groups: dict[int, list[str]] = {}  # per batch its kinds in posting order
        for r in records:
            if r.batch is not None:
                groups.setdefault(r.batch, []).append(r.kind)
        want: list[list[str]] = []
        for tick in rank_program(schedule, rank, join=True).ticks:
            recvs = ["recv"] * len(tick.recvs)
            if tick.ahead and recvs:
                want.append(recvs)
            after = ["send"] * len(tick.sends) + ([] if tick.ahead else recvs)
            if after:
                want.append(after)
        got = list(groups.values())[1:-1]  # without the header and the loss sums
        assert got == want, (rank, got, want)
    last = rank_program(schedule, 1, join=True).ticks
    assert not any(t.ahead and t.sends for t in last)
    assert sum(bool(t.sends and t.recvs) for t in last) == 6
    # The last stage's rank posts the loss sums before it waits for any of its sends, so
    # it need not wake again to post them.
    records = traces[1]
    sums = max(r.batch for r in records if r.batch is not None)
    (posted,) = [r.seq for r in records if r.batch == sums and r.kind == "send"]
    sends = {r.seq for r in records if r.kind == "send"}
    waited = [r.seq for r in records if r.kind == "wait" and set(r.waits_on) <= sends]
    assert waited and min(waited) > posted, (posted, waited)


# ------------------------------------------------------------------ context parallelism
# Each layout: (pp, dp, cp, tp, fsdp) and the runs it records: (schedule, model, strategy).
# "layers": test_pipeline's layer list (scaled_dot_product_attention taken over during
# steps; with tp its MLPs' matrices sharded); "llama": a transformers Llama (conveyor's
# attention through transformers' interface; with tp its own plan, heads over tp).
_RING_FAMILIES = [(name, "layers", "ring") for name in FAMILIES]
CP_LAYOUTS: dict[str, tuple[tuple[int, int, int, int, bool], list[tuple[str, str, str]]]] = {
    "cp4": ((1, 1, 4, 1, False), [("1f1b", "layers", "ring"), ("gpipe", "layers", "all-gather")]),
    "pp2 x cp2": (
        (2, 1, 2, 1, False),
        _RING_FAMILIES
        + [(name, "layers", "all-gather") for name in ("1f1b", "zb-h1", "zbv")]
        + [("1f1b", "llama", "ring"), ("zb-h1", "llama", "all-gather")],
    ),
    "pp2 x cp2 x tp2": (
        (2, 1, 2, 2, False),
        [(name, "layers", "ring") for name in ("1f1b", "zb-h1", "zbv")]
        + [("1f1b", "llama", "ring"), ("interleaved-1f1b", "llama", "all-gather")],
    ),
    "pp2 x cp2 x dp2 fsdp": (
        (2, 2, 2, 1, True),
        [(name, "layers", "ring") for name in ("1f1b", "interleaved-1f1b", "zb-h1")]
        + [("zbv", "layers", "all-gather")],
    ),
}


def _cp_model(kind: str, tp: int) -> tuple[nn.Module, Any, Any]:
    """The model, its loss_fn and its tp_plan."""
    if kind == "llama":
        from tests.context_parallel.test_pipeline import llama

        return llama(), None, "auto" if tp > 1 else None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tests.context_parallel.test_pipeline import layers

    plan = {"*.mlp.0": ColwiseParallel(), "*.mlp.2": RowwiseParallel()} if tp > 1 else None
    return layers(), TokenCrossEntropy(shift=True), plan


def _cp_data(kind: str, step: int, rows: int, length: int) -> Any:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (rows, length), generator=g)
    labels = ids.clone()
    labels[::2, length // 2 :] = -100  # padded rows: other token counts per micro-batch
    return ({"input_ids": ids, "labels": labels}, None) if kind == "llama" else (ids, labels)


def _record_cp(
    rank: int, sizes: tuple[int, int, int, int, bool], runs: list[tuple[str, str, str]]
) -> dict[str, Any]:
    """Each run on this process, recorded: construction, two training steps of other
    shapes, an eval step and a predict; and this process's cp group (global ranks)."""
    pp, dp, cp, tp, fsdp = sizes
    ctx = conveyor.init(pp=pp, dp=dp, cp=cp, tp=tp, timeout=120)
    members = [ctx.rank_at(ctx.dp_rank, ctx.pp_rank, ctx.tp_rank, r) for r in range(cp)]
    out: dict[str, Any] = {"cp": members}
    microbatches = 2 * pp
    for schedule, kind, strategy in runs:
        chunks = default_chunks(schedule)
        model, loss_fn, plan = _cp_model(kind, tp)
        mine = slice(ctx.dp_rank, None, dp)
        shapes = ((2 * microbatches * dp, 16), ((microbatches + 1) * dp, 8))
        with recording(functional=tp > 1) as trace:
            first = _cp_data(kind, 0, *shapes[0])
            pipe = conveyor.Pipeline(
                model, loss_fn=loss_fn, microbatches=microbatches, schedule=schedule,
                chunks=chunks, context=ctx, fsdp=fsdp, tp_plan=plan, cp_attention=strategy,
                sample=_mine(first, mine),
            )  # fmt: skip
            for step, shape in enumerate(shapes):
                pipe.train_step(*_mine(_cp_data(kind, step, *shape), mine))
            pipe.eval_step(*_mine(first, mine))
            pipe.predict(_mine(first, mine)[0])  # whole sequences, gathered over cp
        out[f"{schedule} {kind} {strategy}"] = [r.to_dict() for r in trace]
    return out


def _mine(data: Any, rows: slice) -> Any:
    """A replica's rows of ``(inputs, targets)``."""
    inputs, targets = data
    inputs = {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]
    return inputs, None if targets is None else targets[rows]


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_context_parallel_layouts_are_deadlock_free_under_nccl_rules(layout: str) -> None:
    """cp alone, cp x pp, cp x pp x tp and cp x pp x dp with FSDP: the ring's
    batch_isend_irecv groups (one send to the next cp rank, one receive from the previous,
    on the cp group) and the all-gather strategy's collectives, among the pipeline's
    transfers, the tensor-parallel and FSDP collectives, replay under NCCL's rules."""
    sizes, runs = CP_LAYOUTS[layout]
    pp, dp, cp, tp, _ = sizes
    results = run_forked(_record_cp, pp * dp * cp * tp, sizes, runs, timeout=1500)
    for schedule, kind, strategy in runs:
        key = f"{schedule} {kind} {strategy}"
        traces = {rank: [Record.from_dict(r) for r in res[key]] for rank, res in enumerate(results)}
        try:
            check(traces)
        except AssertionError as exc:
            raise AssertionError(f"{layout}, {key}:\n{exc}") from None
        for rank, records in traces.items():
            members = tuple(results[rank]["cp"])
            on_cp = [r for r in records if r.members == members]
            assert on_cp, (layout, key, rank)
            me = members.index(rank)
            batches: dict[int, list[tuple[str, int | None]]] = {}
            for r in on_cp:
                if r.batch is not None:
                    batches.setdefault(r.batch, []).append((r.kind, r.peer))
            if strategy == "ring":  # each move: a send to the next, a receive from the previous
                want = [("send", members[(me + 1) % cp]), ("recv", members[(me - 1) % cp])]
                assert batches and all(b == want for b in batches.values()), (key, rank)
            else:  # no point-to-point transfer on the cp group: gathers and scatters
                assert not batches, (key, rank)
                names = {r.name for r in on_cp}
                assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= names, names
