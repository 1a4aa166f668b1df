"""conveyor.planning.estimate where the ranks sit: groups as conveyor.init numbers the ranks,
what crosses the network, expert gradients, a recomputed layer's input under tp, and tp
values that cannot split the heads. Every expected value is worked out here by hand."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from transformers import LlamaConfig, MixtralConfig

from conveyor.errors import ConfigError
from conveyor.planning import PRESETS, Layout, estimate
from conveyor.planning.collectives import all_reduce
from conveyor.planning.counting import count_model
from conveyor.planning.search import rank_layouts
from conveyor.schedules import get_schedule
from conveyor.simulate import simulate

H100 = PRESETS["h100-sxm"]  # 8 GPUs a node, NVLink 450 GB/s, network 50 GB/s a GPU
NVLINK, NETWORK = 0.8 * 450e9, 0.8 * 50e9  # bytes/s: nccl-tests' 0.8 of the link
BASE, NV_STEP, NET_STEP = 8.4e-6, 3.4e-6, 14e-6  # NCCL's Simple-protocol latencies
HBM = 0.84 * 3350e9  # bytes/s a memory-bound kernel reaches on an H100
ADAMW = 30  # bytes read and written per parameter by a mixed-precision AdamW step


def llama(layers: int = 8, heads: int = 8, kv_heads: int = 4, h: int = 256) -> LlamaConfig:
    """h 256, MLP 1024, vocabulary 1024, untied: a layer holds 4*256*256 - 2*256*128
    (grouped keys and values at kv 4) + 3*256*1024 + 2*256 = 983,552 parameters, the
    embeddings 262,144, the final norm and head 262,400."""
    return LlamaConfig(
        hidden_size=h,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=1024,
    )


def mixtral(kv_heads: int = 2) -> MixtralConfig:
    """h 256, 4 heads, 4 layers of 8 experts of 3 x 256 x 512, 2 chosen per token."""
    return MixtralConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def mesh_rank(dp_rank: int, pp_rank: int, tp_rank: int, pp: int, tp: int) -> int:
    """conveyor.init's numbering (DESIGN.md): (dp_rank * pp + pp_rank) * tp + tp_rank."""
    return (dp_rank * pp + pp_rank) * tp + tp_rank


@pytest.mark.parametrize("pp,tp,dp,ep", [(2, 4, 2, 1), (4, 2, 4, 2), (1, 8, 4, 4), (3, 1, 6, 3)])
def test_groups_are_conveyor_inits_ranks(pp: int, tp: int, dp: int, ep: int) -> None:
    layout = Layout(pp, tp=tp, dp=dp, ep=ep, global_batch=dp, seq=8)
    edp = dp // ep  # dp_rank = edp_rank * ep + ep_rank
    rank0 = {
        "tp": [mesh_rank(0, 0, t, pp, tp) for t in range(tp)],
        "pp": [mesh_rank(0, p, 0, pp, tp) for p in range(pp)],
        "dp": [mesh_rank(d, 0, 0, pp, tp) for d in range(dp)],
        "ep": [mesh_rank(e, 0, 0, pp, tp) for e in range(ep)],
        "edp": [mesh_rank(r * ep, 0, 0, pp, tp) for r in range(edp)],
    }
    for axis, ranks in rank0.items():
        size, stride = layout.group(axis)
        assert [i * stride for i in range(size)] == ranks, axis


def test_a_data_parallel_group_pp_times_tp_apart_crosses_the_network() -> None:
    """pp 2, tp 4, dp 2 on 8-GPU nodes: a replica is ranks 0-7, so the data-parallel group
    of rank 0 is ranks 0 and 8, two nodes. A 1 GB all-reduce of two ranks across nodes is
    a ring of 2 network steps moving 2(n-1)/n = 1 of the bytes at 40 GB/s (within a node
    it would take 1/9 of that)."""
    layout = Layout(2, tp=4, dp=2, global_batch=8, seq=256)
    assert layout.group("dp") == (2, 8)
    assert all_reduce(H100, 1e9, *layout.group("dp")) == pytest.approx(
        BASE + 2 * NET_STEP + 1e9 / NETWORK, rel=1e-12
    )
    far = Layout(2, tp=8, dp=2, global_batch=8, seq=256)  # ranks 0 and 16: still two nodes
    assert all_reduce(H100, 1e9, *far.group("dp")) == pytest.approx(
        BASE + 2 * NET_STEP + 1e9 / NETWORK, rel=1e-12
    )
    est = estimate(llama(), hardware=H100, layout=layout)
    # balance (4, 4), tp 4: the first rank holds 4 layers and the embeddings, the last 4
    # layers, the final norm and the head. Each rank's fp32 gradients are reduced once its
    # last backward has ended (conveyor's runtime), then it steps its optimizer; the step
    # ends with the later of the two.
    assert est.balance == (4, 4)
    sim = simulate(get_schedule("1f1b", 2, layout.microbatches), list(est.stage_times),
                   comm=BASE + NV_STEP + 256 * 2 * 256 / 4 / NVLINK)  # fmt: skip
    ends = [max(e.end for e in sim.events if e.rank == r) for r in (0, 1)]
    done = []
    rank_params = ((4 * 983_552 + 262_144) / 4, (4 * 983_552 + 262_400) / 4)
    for end, params in zip(ends, rank_params, strict=True):
        reduce = BASE + 2 * NET_STEP + 4 * params / NETWORK
        done.append(end + reduce + ADAMW * params / HBM)
    assert ends[1] < ends[0]  # the last stage's last backward ends first
    assert est.sync_s == pytest.approx(max(done) - sim.makespan, rel=1e-12)
    assert est.step_s == pytest.approx(max(done), rel=1e-12)


def test_every_stage_in_one_node_sends_over_nvlink() -> None:
    """A pipeline of 8 on an 8-GPU node, and pipelines of 2 x tp 4 that fill a node each,
    send a micro-batch's hidden states (256 x 2 bytes x 512 tokens / tp) over NVLink; pp 4
    x tp 4 spans two nodes and some boundary crosses the network. The step before the
    gradient reduction is the schedule simulated with that transfer time."""
    tokens = 256 * 2 * 512

    def pipeline_s(layout: Layout) -> tuple[float, float]:
        est = estimate(llama(), hardware=H100, layout=layout)
        sim = simulate(
            get_schedule("1f1b", layout.pp, layout.microbatches),
            list(est.stage_times),
            comm=send,
        )
        return est.step_s - est.sync_s, sim.makespan

    send = BASE + NV_STEP + tokens / NVLINK
    got, want = pipeline_s(Layout(8, global_batch=16, seq=512))
    assert got == pytest.approx(want, rel=1e-12)
    send = BASE + NV_STEP + tokens / 4 / NVLINK
    got, want = pipeline_s(Layout(2, tp=4, dp=2, global_batch=16, seq=512))
    assert got == pytest.approx(want, rel=1e-12)
    send = BASE + NET_STEP + tokens / 4 / NETWORK
    got, want = pipeline_s(Layout(4, tp=4, global_batch=16, seq=512))
    assert got == pytest.approx(want, rel=1e-12)


def test_expert_gradients_are_reduced_over_dp_over_ep_replicas() -> None:
    """Mixtral, h 256, 4 layers of 8 experts of 3 x 256 x 512 (3,145,728 a layer), dense
    4 x 199,168 + 262,144 + 262,400 = 1,321,216. At dp 4, ep 2 each rank holds half the
    experts, and each half is on 2 replicas: its gradients are all-reduced among 2 ranks,
    the dense ones among 4 (rings inside a node: 2(n-1) NVLink steps, 2(n-1)/n of the
    bytes)."""
    layout = Layout(1, dp=4, ep=2, global_batch=8, seq=128)
    est = estimate(mixtral(), hardware=H100, layout=layout)
    dense, experts = 1_321_216, 4 * 3_145_728 / 2
    dense_s = BASE + 6 * NV_STEP + 4 * dense * 2 * 3 / 4 / NVLINK
    experts_s = BASE + 2 * NV_STEP + 4 * experts * 2 * 1 / 2 / NVLINK
    optimizer_s = ADAMW * (dense + experts) / HBM
    assert est.sync_s == pytest.approx(dense_s + experts_s + optimizer_s, rel=1e-12)


def test_an_expert_all_to_all_between_replicas_crosses_the_network() -> None:
    """pp 2, tp 4, dp 2, ep 2: the two expert-parallel ranks are consecutive replicas,
    ranks 0 and 8, on two nodes. Each layer's F and B add two all-to-alls of its routed
    tokens (128 tokens x 2 experts x 256 x 2 bytes, over tp 4), half of them sent away."""
    config = mixtral(kv_heads=4)  # tp 4 splits the heads
    base = dict(pp=2, tp=4, dp=2, global_batch=8, seq=128)
    alone = estimate(config, hardware=H100, layout=Layout(**base))
    spread = estimate(config, hardware=H100, layout=Layout(**base, ep=2))
    assert spread.balance == (2, 2)
    a2a = BASE + NET_STEP + 128 * 2 * 256 * 2 / 4 / 2 / NETWORK
    for (f1, b1, w1), (f2, b2, w2) in zip(alone.stage_times, spread.stage_times, strict=True):
        assert (f2 - f1, b2 - b1, w2 - w1) == pytest.approx((4 * a2a, 4 * a2a, 0), rel=1e-9)


def test_a_recomputed_layer_keeps_its_input_split_by_tp() -> None:
    """6 layers on pp 4 split (1, 2, 2, 1); 1F1B's second rank holds pp - 1 = 3
    micro-batches at its peak; with layer recompute each of its 2 layers keeps only its
    input, 256 x 2 bytes x 256 tokens, of which sequence parallelism leaves 1/4 on each
    rank, and the B of one of them holds a layer's whole activations (1/4 of them)
    while it runs, with that backward's temporaries."""
    layout = Layout(4, tp=4, global_batch=8, seq=256, recompute="layer")
    est = estimate(llama(layers=6), hardware=H100, layout=layout)
    assert est.balance == (1, 2, 2, 1)
    counted = count_model(llama(layers=6), 256).layers[1]
    layer, temporaries = counted.saved_bytes / 4, counted.workspace / 4
    kept = 256 * 2 * 256 / 4
    want = 3 * 2 * kept + (layer - kept) + temporaries
    assert est.memory_parts[1]["activations"] * 1e9 == pytest.approx(want, rel=1e-12)


def test_a_tp_that_cannot_split_the_heads_is_refused_and_never_ranked() -> None:
    """12 heads (and 12 key/value heads) split over 1, 2 or 4 ranks of a node of 8, not 8;
    8 heads with 2 key/value heads over 1 or 2 only."""
    layout = Layout(1, tp=8, global_batch=8, seq=64)
    with pytest.raises(
        ConfigError,
        match=r"^tp=8 cannot split the model's 12 attention heads \(12 key/value heads\) "
        r"evenly; use a tp among 1, 2, 3, 4, 6, 12$",
    ):
        estimate(llama(layers=2, heads=12, kv_heads=12, h=384), hardware=H100, layout=layout)
    with pytest.raises(ConfigError, match=r"\(2 key/value heads\) evenly; use a tp among 1, 2$"):
        estimate(llama(layers=2, heads=8, kv_heads=2), hardware=H100, layout=Layout(
            1, tp=4, global_batch=8, seq=64))  # fmt: skip
    for heads, kv_heads, tps in ((12, 12, {1, 2, 4}), (8, 2, {1, 2})):
        ranked = rank_layouts(
            llama(layers=2, heads=heads, kv_heads=kv_heads, h=32 * heads),
            hardware=H100,
            gpus=8,
            seq=64,
            global_batch=8,
        )
        assert {r.layout.tp for r in ranked} == tps
