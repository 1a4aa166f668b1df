"""Data x pipeline parallelism and whole-model gradient clipping equal the unsplit model.

pp=2 x dp=2 on 4 processes (each replica trains on its own, possibly uneven, shard of the
global batch), pure data parallelism, clipping on 2 processes and in the one-process
world, and the world-size errors. Few spawns: 4-process worlds are slow on 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support import distributed, nccl_record
from tests.support.helpers import (
    assert_close,
    grads_of,
    lm_loss,
    merge_tied,
    mse,
    params_of,
    tied_names,
)
from tests.support.models import mlp
from tests.support.zoo import TinyGPT

Batch = tuple[torch.Tensor, torch.Tensor]
# Per step: (loss, clip norm or None, grads, params after the optimizer step).
Trace = list[tuple[float, float | None, dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def build(kind: str, stages: int) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """A fresh model (same weights every call) and its loss."""
    if kind == "gpt":  # embedding tied to the head: copies on the first and last rank
        gpt = TinyGPT(layers=4)
        for s in range(1, stages):
            gpt.blocks[s * 4 // stages].pipeline_stage = s  # type: ignore[assignment]
        return gpt, lm_loss
    return mlp(layers=4, width=12), mse


def batches(kind: str, sizes: list[int]) -> list[Batch]:
    g = torch.Generator().manual_seed(7)
    if kind == "gpt":
        idx = [torch.randint(0, 11, (n, 5), generator=g) for n in sizes]
        return [(i[:, :-1], i[:, 1:]) for i in idx]
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for n in sizes]


# name: (model, schedule, chunks, micro-batches, per step the shard sizes of each replica,
#        optimizer, clip (max_norm, norm_type) or None, zero the gradients between steps)
Config = tuple[str, str, int, int, list[list[int]], str, tuple[float, float] | None, bool]
DP_CONFIGS: dict[str, Config] = {
    "1f1b": ("mlp", "1f1b", 1, 2, [[6, 6], [7, 4], [5, 8]], "sgd", (0.05, 2.0), True),
    "zb-h1": ("mlp", "zb-h1", 1, 3, [[5, 7], [8, 6], [6, 3]], "adamw", (0.01, float("inf")), True),
    # no zero_grad between steps: .grad accumulates, as after backward()
    "interleaved": ("mlp", "interleaved-1f1b", 2, 2, [[4, 6], [6, 6], [7, 5]], "sgd", None, False),
    "gpt": ("gpt", "zb-h1", 1, 2, [[3, 5], [4, 4], [6, 2]], "sgd", (0.5, 2.0), True),
    # V placement: the tied embedding and head are one parameter in two stages of rank 0
    "zbv-gpt": ("gpt", "zbv", 2, 4, [[4, 5], [6, 4], [4, 4]], "sgd", (0.5, 2.0), True),
}


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1)


def train(
    named: list[tuple[str, nn.Parameter]],
    step: Callable[[Any, Any], torch.Tensor],
    clip: Callable[[float, float], torch.Tensor],
    data: list[Batch],
    config: Config,
) -> Trace:
    optimizer, clipping, zero = config[5], config[6], config[7]
    opt = _optimizer(optimizer, [p for _, p in named])
    out: Trace = []
    for x, y in data:
        loss = float(step(x, y))
        norm = None if clipping is None else float(clip(*clipping))
        grads = grads_of(named)
        opt.step()
        if zero:
            opt.zero_grad()
        out.append((loss, norm, grads, params_of(named)))
    return out


def reference(config: Config, stages: int) -> tuple[Trace, float]:
    """The unsplit model on the global batches; and its eval loss on the last one."""
    kind, shards = config[0], config[4]
    model, loss_fn = build(kind, stages)
    data = batches(kind, [sum(s) for s in shards])

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    def clip(max_norm: float, norm_type: float) -> torch.Tensor:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        assert norm > max_norm, "the test should clip"
        return norm

    trace = train(list(model.named_parameters()), step, clip, data, config)
    with torch.no_grad():
        x, y = data[-1]
        return trace, float(loss_fn(model(x), y))


def _shard(batch: Batch, sizes: list[int], replica: int) -> Batch:
    start = sum(sizes[:replica])
    end = start + sizes[replica]
    return batch[0][start:end], batch[1][start:end]


def pipelined(
    ctx: conveyor.Context, config: Config
) -> tuple[Trace, float, tuple[int, int]]:
    """This rank's trace of ``config`` on its replica's shards; its eval loss on the last
    batch; of the gradients' all-reduces it posted, how many started before the end of
    their step, and how many there were."""
    kind, sched, chunks, m, shards = config[:5]
    model, loss_fn = build(kind, ctx.pp_size * chunks)
    pipe = conveyor.Pipeline(
        model, loss_fn=loss_fn, microbatches=m, schedule=sched, chunks=chunks, context=ctx
    )
    data = [
        _shard(b, sizes, ctx.dp_rank)
        for b, sizes in zip(batches(kind, [sum(s) for s in shards]), shards, strict=True)
    ]
    with nccl_record.recording(functional=False) as posted:
        trace = train(
            list(pipe.named_parameters()), pipe.train_step, pipe.clip_grad_norm_, data, config
        )
    # The gradients' all-reduces, and how many were started by the engine's hook as a
    # stage's last backward ran (the rest at the step's end).
    sums = [r for r in posted if r.kind == "collective" and "data_parallel.py" in r.where]
    early = sum(any(" in after_action" in f for f in r.stack) for r in sums)
    return trace, float(pipe.eval_step(*data[-1])), (early, len(sums))


def check(name: str, config: Config, pp: int, traces: list[tuple[Trace, float]]) -> None:
    """``traces``: every rank's, in global rank order (replica by replica)."""
    kind, chunks = config[0], config[2]
    want, want_eval = reference(config, pp * chunks)
    alias = tied_names(build(kind, pp * chunks)[0])
    replicas = [traces[r : r + pp] for r in range(0, len(traces), pp)]
    for i, (loss, norm, grads, params) in enumerate(want):
        what = f"{name} pp={pp} dp={len(replicas)} step {i}"
        for trace, _ in traces:
            assert trace[i][0] == pytest.approx(loss, rel=1e-5), what + " loss"
            if norm is not None:
                assert trace[i][1] == pytest.approx(norm, rel=1e-5), what + " clip norm"
        for r, replica in enumerate(replicas):
            got_grads = merge_tied([t[i][2] for t, _ in replica], alias, f"{what} replica {r}")
            assert_close(got_grads, grads, f"{what} replica {r} grads")
            got_params = merge_tied([t[i][3] for t, _ in replica], alias, f"{what} replica {r}")
            assert_close(got_params, params, f"{what} replica {r} params")
    for _, got_eval in traces:
        assert got_eval == pytest.approx(want_eval, rel=1e-5), name + " eval loss"


# ---------------------------------------------------------------------------- 4 processes
def _pp2_dp2(rank: int, trace: str) -> dict[str, Any]:
    with pytest.raises(conveyor.ConfigError, match="world size 4 is not pp x dp x tp = 3 x 2 x 1"):
        conveyor.init(pp=3, dp=2)
    with pytest.raises(conveyor.ConfigError, match="dp x tp = 3 does not divide the world size 4"):
        conveyor.init(dp=3)
    ctx = conveyor.init(pp=2, dp=2)
    layout = (ctx.rank, ctx.pp_rank, ctx.dp_rank, ctx.global_rank(0), ctx.global_rank(1))
    out = {name: pipelined(ctx, config) for name, config in DP_CONFIGS.items()}
    # Measurement collectives run within each replica; rank 0 writes replica 0's trace.
    pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, context=ctx)
    pipe.train_step(*batches("mlp", [8])[0])
    pipe.save_trace(trace)
    return {"layout": layout, "bubble": pipe.measured_bubble(), **out}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_x_dp2_equals_the_unsplit_model_on_the_global_batch(tmp_path: Path) -> None:
    results = distributed.run(_pp2_dp2, 4, str(tmp_path / "trace.json"), fork=True)
    assert [r["layout"] for r in results] == [
        (0, 0, 0, 0, 1),
        (1, 1, 0, 0, 1),
        (2, 0, 1, 2, 3),
        (3, 1, 1, 2, 3),
    ]
    for name, config in DP_CONFIGS.items():
        check(name, config, 2, [(r[name][0], r[name][1]) for r in results])
        # every bucket of every step started as its stage finished, not at the end
        early, launched = zip(*(r[name][2] for r in results), strict=True)
        assert early == launched and min(launched) >= 3, name
    assert all(0 <= r["bubble"] < 1 for r in results)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e.get("ph") == "X"} == {0, 1}


# ---------------------------------------------------------------------------- 2 processes
CLIP_CONFIGS: dict[str, Config] = {
    "1f1b": ("mlp", "1f1b", 1, 3, [[9], [10]], "sgd", (0.05, 2.0), True),
    "gpt": ("gpt", "1f1b", 1, 2, [[5], [6]], "sgd", (0.2, float("inf")), True),
    "interleaved-gpt": ("gpt", "interleaved-1f1b", 2, 2, [[5], [4]], "sgd", (0.5, 3.0), True),
}
PURE_DP: Config = ("mlp", "1f1b", 1, 2, [[4, 6], [5, 5]], "adamw", (0.01, 2.0), True)


def _two_processes(rank: int) -> dict[str, Any]:
    with pytest.raises(conveyor.ConfigError, match="world size 2 is not pp x dp x tp = 2 x 2 x 1"):
        conveyor.init(pp=2, dp=2)
    out: dict[str, Any] = {"pure-dp": pipelined(conveyor.init(pp=1, dp=2), PURE_DP)}
    ctx = conveyor.init(pp=2)
    out.update({name: pipelined(ctx, config) for name, config in CLIP_CONFIGS.items()})
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_clip_grad_norm_on_two_ranks_and_pure_data_parallelism() -> None:
    results = distributed.run(_two_processes, 2, fork=True)
    for name, config in CLIP_CONFIGS.items():
        check(name, config, 2, [(r[name][0], r[name][1]) for r in results])
    check("pure-dp", PURE_DP, 1, [(r["pure-dp"][0], r["pure-dp"][1]) for r in results])


# ---------------------------------------------------------------------------- 1 process
@pytest.mark.parametrize("name", sorted(CLIP_CONFIGS))
def test_clip_grad_norm_in_the_one_process_world(name: str) -> None:
    config = CLIP_CONFIGS[name]
    check(name, config, 2, [pipelined(conveyor.init(pp=2), config)[:2]])


def test_dp_needs_processes_in_the_one_process_world() -> None:
    with pytest.raises(conveyor.ConfigError, match="dp=2 x tp=1 needs pp x dp x tp processes"):
        conveyor.init(pp=2, dp=2)


def test_clip_grad_norm_rejects_a_bad_norm_type() -> None:
    pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, context=conveyor.init(pp=2))
    with pytest.raises(conveyor.ConfigError, match="norm_type must be > 0 or inf"):
        pipe.clip_grad_norm_(1.0, norm_type=0.0)
