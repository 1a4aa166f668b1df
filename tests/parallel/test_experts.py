"""Expert parallelism without the pipeline: experts sharded over ep, exact against the
unsplit model.

Tiny Mixtral, Qwen2-MoE (with shared experts) and OLMoE built from configs. Each
data-parallel replica runs the sharded model on its own shard of a batch (padded labels,
one sequence length per replica) with the loss normalised by the whole batch's token
count, the gradients are summed by ``DataParallel`` (experts over the replicas holding the
same experts, the rest over dp), and loss and every gradient (experts gathered whole) must
equal the unsplit model's on the whole batch. Also: routing skewed so that one ep rank
receives no token, each rank's expert parameters being its share, and the errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.errors import ConfigError
from conveyor.experts import apply_ep, find_experts, is_expert_parameter
from tests.support import distributed
from tests.support.helpers import assert_close

transformers = pytest.importorskip("transformers")

EXPERTS = 4
Shard = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels)


def tiny_moe(kind: str, layers: int = 2) -> nn.Module:
    """A tiny MoE language model (4 experts, top-2, ``layers`` layers), the same weights
    every call."""
    common: dict[str, Any] = dict(
        vocab_size=37, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=12, num_local_experts=EXPERTS, router_jitter_noise=0.0, **common
        )
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_experts=EXPERTS, decoder_sparse_step=1, norm_topk_prob=False, **common,
        )  # fmt: skip
    elif kind == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=12, num_experts=EXPERTS, **common)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.float().train()


def skew(model: nn.Module, experts: int) -> None:
    """Route every token only to experts ``< experts`` (those of ep rank 0): a forward hook on
    each router folds the chosen experts' ids into that range (the weights stay)."""

    def fold(module: nn.Module, args: Any, out: Any) -> Any:
        logits, weights, index = out
        return logits, weights, index % experts

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(fold)


def shards() -> list[Shard]:
    """Two replicas' shards of one batch: other lengths (7 and 5), labels padded with -100."""
    g = torch.Generator().manual_seed(3)
    out = []
    for rows, length, pads in ((3, 7, [0, 2, 4]), (2, 5, [1, 3])):
        ids = torch.randint(0, 37, (rows, length), generator=g)
        labels = ids.clone()
        for r, pad in enumerate(pads):
            if pad:
                labels[r, -pad:] = -100
        out.append((ids, labels))
    return out


def items(batch: list[Shard]) -> int:
    """Tokens the whole batch's loss averages over (labels are shifted by the model)."""
    return sum(int((labels[:, 1:] != -100).sum()) for _, labels in batch)


def reference(kind: str, skewed: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model's loss and gradients over the whole batch."""
    model = tiny_moe(kind)
    if skewed:
        skew(model, EXPERTS // 2)
    return accumulated(model, shards())


def accumulated(model: nn.Module, batch: list[Shard]) -> tuple[float, dict[str, torch.Tensor]]:
    """``model``'s loss and gradients over ``batch``, accumulated shard by shard, each
    called with the whole batch's token count."""
    count = torch.tensor(items(batch))
    total = 0.0
    for ids, labels in batch:
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=count).loss
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


def replica(rank: int, kind: str, dp: int, ep: int, skewed: bool) -> dict[str, Any]:
    """One replica's run: shard the experts, forward and backward its shard, sum the
    gradients by the data-parallel rule; returns the whole loss, the gradients (experts
    gathered whole), and its expert shards."""
    from conveyor.runtime.data_parallel import DataParallel
    from conveyor.runtime.program import single_process_program
    from conveyor.schedules import one_f_one_b

    ctx = conveyor.init(pp=1, dp=dp, ep=ep)
    model = tiny_moe(kind)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    if skewed:
        skew(model, EXPERTS // ep)
    sharded = apply_ep(model, None, ctx)
    received: list[int] = []
    _count_received(received)
    batch = shards() * (dp // 2)  # dp replicas: the two shards repeated
    mine = batch[ctx.dp_rank]
    count = torch.tensor(items(batch))
    schedule = one_f_one_b(1, 1)
    sync = DataParallel({0: model}, ctx)
    sync.begin(single_process_program(schedule))
    loss = model(input_ids=mine[0], labels=mine[1], num_items_in_batch=count).loss
    loss.backward()
    sync.finish()
    total = loss.detach().clone()
    dist.all_reduce(total, group=ctx.dp_group)
    grads, local = {}, {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads[name] = p.grad.full_tensor() if is_expert_parameter(p) else p.grad.clone()
        if is_expert_parameter(p):
            local[name] = (p.to_local().clone(), whole[name])
    return dict(
        loss=float(total), grads=grads, local=local, sharded=sharded, ep_rank=ctx.ep_rank,
        received=received,
    )  # fmt: skip


def _count_received(received: list[int]) -> None:
    """Record, per expert-collection call, the (token, expert) rows this rank receives."""
    from conveyor.experts import dispatch

    exchange = dispatch.exchange_counts

    def counting(counts: torch.Tensor, group: Any, timeout: float) -> torch.Tensor:
        out = exchange(counts, group, timeout)
        received.append(int(out.sum()))
        return out

    dispatch.exchange_counts = counting  # type: ignore[assignment]


# ------------------------------------------------------------------------------- one process
def test_find_experts_default_and_patterns() -> None:
    """Default: every transformers experts module; patterns: those they name; the shared
    expert and routers are not collections."""
    model = tiny_moe("qwen2_moe")
    names = [n for n, _ in find_experts(model.named_modules())]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert [n for n, _ in find_experts(model.named_modules(), ["*.1.mlp.experts"])] == names[1:]
    with pytest.raises(ConfigError, match="matches no module"):
        find_experts(model.named_modules(), ["model.layers.*.moe"])
    with pytest.raises(ConfigError, match="not an expert collection"):
        find_experts(model.named_modules(), ["model.layers.0.mlp.shared_expert"])
    with pytest.raises(ConfigError, match="list of module-name patterns"):
        find_experts(model.named_modules(), "model.layers.*.mlp.experts")  # type: ignore[arg-type]


def test_one_process_world() -> None:
    """ep=1 works in one process (nothing is sharded); ep that does not divide dp, or ep > 1
    without processes, is one sentence."""
    ctx = conveyor.init(pp=1, ep=1)
    assert (ctx.ep_rank, ctx.ep_size) == (0, 1)
    model = tiny_moe("mixtral")
    assert apply_ep(model, None, ctx) == []
    assert apply_ep(model, ["model.layers.*.mlp.experts"], ctx) == []
    with pytest.raises(ConfigError, match="ep=2 does not divide dp=1"):
        conveyor.init(pp=1, ep=2)
    with pytest.raises(ConfigError, match="ep=2 does not divide dp=3"):
        conveyor.init(pp=1, dp=3, ep=2)
    with pytest.raises(ConfigError, match="ep must be an int >= 1"):
        conveyor.init(ep=0)
    with pytest.raises(ConfigError, match="needs pp x dp x tp processes"):
        conveyor.init(pp=1, dp=2, ep=2)


def test_experts_count_not_divisible() -> None:
    """4 experts over ep=3: one sentence naming the module (checked before any sharding)."""

    class Ctx:
        ep_size = 3

    model = tiny_moe("olmoe")
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts has 4 experts, which ep=3"):
        apply_ep(model, None, Ctx)


# ------------------------------------------------------------------------------ processes
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe"])
def test_dp2_ep2_exact(kind: str) -> None:
    """dp=2 x ep=2: loss and every gradient equal the unsplit model's on the whole batch;
    each rank holds its half of the experts."""
    want_loss, want = reference(kind, skewed=False)
    results = distributed.run(replica, 2, kind, 2, 2, False, fork=True)
    for rank, got in enumerate(results):
        assert abs(got["loss"] - want_loss) < 1e-5 * abs(want_loss), (got["loss"], want_loss)
        assert_close(got["grads"], want, f"rank {rank} gradients")
        assert got["sharded"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert got["local"], "no expert shards"
        for name, (local, whole) in got["local"].items():
            n = EXPERTS // 2
            assert local.shape == (n, *whole.shape[1:]), name
            assert torch.equal(local, whole[rank * n : (rank + 1) * n]), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_skewed_routing_one_rank_idle() -> None:
    """Every token goes to ep rank 0's experts: rank 1 receives no token, its expert
    gradients are zero, and the result is still exact."""
    want_loss, want = reference("mixtral", skewed=True)
    results = distributed.run(replica, 2, "mixtral", 2, 2, True, fork=True)
    assert results[1]["received"] == [0, 0] and min(results[0]["received"]) > 0
    for rank, got in enumerate(results):
        assert abs(got["loss"] - want_loss) < 1e-5 * abs(want_loss)
        experts = {n for n in want if ".experts." in n}
        for n in experts:  # rank 1's half of each expert gradient is zero in the reference
            assert float(want[n][EXPERTS // 2 :].abs().max()) == 0.0
        assert_close(
            {n: g for n, g in got["grads"].items() if n in want},
            want, f"rank {rank} gradients",
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp4_ep2_expert_replicas() -> None:
    """dp=4 x ep=2: experts are summed over the 2 replicas holding the same experts (ranks
    {0, 2} and {1, 3}), the rest over all 4; exact against the unsplit model."""
    total, want = accumulated(tiny_moe("olmoe"), shards() * 2)
    results = distributed.run(replica, 4, "olmoe", 4, 2, False, fork=True)
    for rank, got in enumerate(results):
        assert got["ep_rank"] == rank % 2
        assert abs(got["loss"] - total) < 1e-5 * abs(total)
        assert_close(got["grads"], want, f"rank {rank} gradients")


def compiled_replica(rank: int) -> dict[str, Any]:
    """The sharded model eager, then through ``torch.compile`` (aot_eager): the graphs hold
    the count exchange as the opaque ``conveyor::all_to_all_counts`` op and never
    ``torch.distributed``'s own calls, and the gradients are the eager ones."""
    ctx = conveyor.init(pp=1, dp=2, ep=2)
    model = tiny_moe("mixtral")
    apply_ep(model, None, ctx)
    batch = shards()
    ids, labels = batch[ctx.dp_rank]
    count = torch.tensor(items(batch))

    def run(fn: Any) -> tuple[float, dict[str, torch.Tensor]]:
        for p in model.parameters():
            p.grad = None
        loss = fn(input_ids=ids, labels=labels, num_items_in_batch=count).loss
        loss.backward()
        grads = {
            n: (p.grad.to_local() if is_expert_parameter(p) else p.grad).clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        return float(loss.detach()), grads

    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_compiler

        return aot_autograd(fw_compiler=make_boxed_compiler(lambda g, _: g.forward))(gm, example)

    eager = run(model)
    compiled = run(torch.compile(model, backend=backend))
    text = "\n".join(graphs)
    return dict(
        eager=eager, compiled=compiled, ops=text.count("conveyor.all_to_all"),
        dist=text.count("all_to_all_single"),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_experts_equal_eager() -> None:
    """torch.compile does not trace into the all-to-all, and changes no gradient."""
    for got in distributed.run(compiled_replica, 2):
        (l0, g0), (l1, g1) = got["eager"], got["compiled"]
        assert l0 == pytest.approx(l1, rel=1e-6)
        assert_close(g1, g0, "compiled gradients")
        assert got["ops"] >= 1 and got["dist"] == 0


def recorded_replica(rank: int) -> Any:
    """What this rank posts in one forward and backward of the sharded model."""
    from tests.support import nccl_record

    ctx = conveyor.init(pp=1, dp=2, ep=2)
    model = tiny_moe("olmoe")
    apply_ep(model, None, ctx)
    batch = shards()
    ids, labels = batch[ctx.dp_rank]
    with nccl_record.recording() as trace:
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=items(batch)).loss
        loss.backward()
    return trace


@pytest.mark.slow
@pytest.mark.multiprocess
def test_all_to_alls_replay_under_nccl_rules() -> None:
    """Every all-to-all (counts, dispatch, combine, and the backward ones) is posted by both
    ep ranks in the same order: the replay under NCCL's rules finds no deadlock."""
    from tests.support import nccl_model

    traces = distributed.run(recorded_replica, 2, fork=True)
    names = [r.name for r in traces[0] if r.kind == "collective"]
    # 2 layers: per forward counts + dispatch + combine, per backward combine + dispatch
    assert names.count("all_to_all_single") == 2 * 5, names
    nccl_model.check(dict(enumerate(traces)))
