"""Tensor parallelism on transformers decoders with data, FSDP and expert parallelism:
pp=2 x dp=2 x tp=2 with ep=2 (8 processes, gloo), exact against the unsplit model.

One world (forked; the captures are made here) runs:

- a Llama with ``tp_plan="auto"`` and ``fsdp=True`` (FSDP2 over dp on top of the tp
  shards): gradients gathered whole;
- the same with ``fsdp="reshard"`` (each kept projection an FSDP unit of its own);
- a Mixtral with ``tp_plan="auto"`` and its experts over ep (an ep group: the two dp ranks
  of one pp rank and tp rank): attention sharded over tp, each rank holding half the
  experts; every local shard against its slice of the unsplit gradient; and the same
  with ``fsdp=True`` (gradients gathered whole).

Each replica trains on every other row of the 5-row batches (3 and 2 rows, in 2
micro-batches: uneven), the loss is the whole batch's (tests/support/tp_models.py).
"""

from __future__ import annotations

from typing import Any

import pytest

import conveyor
from tests.support import tp_models as M
from tests.support.trainer_forked import run_forked

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MICRO = 2  # per replica: 3 rows as (2, 1), 2 rows as (1, 1)


def _pipe(model: Any, dp_rank: int, **options: Any) -> conveyor.Pipeline:
    first = {k: v[dp_rank::2] for k, v in M.batches()[0].items()}
    return conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO, tp_plan="auto",
                             sample=(first, None), **options)  # fmt: skip


def world(rank: int, models: dict[str, Any]) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, dp=2, tp=2, ep=2, timeout=200)
    out: dict[str, Any] = {"ranks": {"tp": ctx.tp_rank, "ep": ctx.ep_rank, "dp": ctx.dp_rank}}
    fsdp = _pipe(models["llama"], ctx.dp_rank, fsdp=True)
    out["fsdp"] = M.train(fsdp, ctx.dp_rank, 2, full=True)
    reshard = _pipe(models["llama reshard"], ctx.dp_rank, fsdp="reshard")
    out["reshard"] = M.train(reshard, ctx.dp_rank, 2, full=True)
    ep = _pipe(models["mixtral"], ctx.dp_rank)
    out["ep"] = M.train(ep, ctx.dp_rank, 2)
    ep_fsdp = _pipe(models["mixtral fsdp"], ctx.dp_rank, fsdp=True)
    out["ep fsdp"] = M.train(ep_fsdp, ctx.dp_rank, 2, full=True)
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    want = {kind: M.reference(kind) for kind in ("llama", "mixtral")}
    models = {kind: M.captured(M.tiny(kind), "auto", 2) for kind in ("llama", "mixtral")}
    models["llama reshard"] = M.captured(M.tiny("llama"), "auto", 2)
    models["mixtral fsdp"] = M.captured(M.tiny("mixtral"), "auto", 2)
    got = run_forked(world, 8, models, timeout=1200)
    return dict(want=want, got=got)


def _exact(results: dict[str, Any], key: str, kind: str) -> None:
    held: set[str] = set()
    sizes = {"tp": 2, "ep": 2, "dp": 2}
    for rank, got in enumerate(results["got"]):
        held |= M.check(got[key], results["want"][kind], got["ranks"], sizes, f"{key} rank {rank}")
    assert held == set(results["want"][kind][0][1]), f"{key}: parameters no rank holds"


def test_fsdp_with_tensor_parallelism(results: dict[str, Any]) -> None:
    _exact(results, "fsdp", "llama")


def test_fsdp_reshard_with_tensor_parallelism(results: dict[str, Any]) -> None:
    """fsdp="reshard": each kept projection its own FSDP unit."""
    _exact(results, "reshard", "llama")


def test_expert_parallelism_tensor_parallelism_and_fsdp(results: dict[str, Any]) -> None:
    _exact(results, "ep fsdp", "mixtral")


def test_tensor_parallel_attention_with_expert_parallel_experts(results: dict[str, Any]) -> None:
    _exact(results, "ep", "mixtral")
    cuts = {n: c for r in results["got"] for n, (_, c) in r["ep"][0][1].items()}
    assert cuts["model.layers.0.self_attn.q_proj.weight"] == "tp:S(0)"
    assert cuts["model.layers.0.mlp.experts.gate_up_proj"].endswith("S(0)")
    assert "ep" in cuts["model.layers.0.mlp.experts.gate_up_proj"]
