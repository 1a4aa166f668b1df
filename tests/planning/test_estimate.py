"""conveyor.planning.estimate: FLOPs counted on meta against the closed forms, the memory
parts' accounting, the hardware and layout checks, and the ranking of layouts."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("transformers")
from transformers import GPT2Config, LlamaConfig, MixtralConfig

from conveyor.errors import ConfigError
from conveyor.planning import PRESETS, Hardware, Layout, estimate
from conveyor.planning.collectives import all_gather, all_reduce, p2p
from conveyor.planning.counting import count_model
from conveyor.planning.model_count import ATTENTION, MATMUL
from conveyor.planning.search import rank_layouts


def gpt(
    h: int = 512,
    layers: int = 4,
    heads: int = 8,
    vocab: int = 4096,
    seq: int = 1024,
    tied: bool = True,
) -> GPT2Config:
    return GPT2Config(
        n_embd=h,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        tie_word_embeddings=tied,
    )


def llama(layers: int = 8, h: int = 256, heads: int = 8) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        vocab_size=1024,
    )


def mixtral(h: int, layers: int, vocab: int) -> MixtralConfig:
    """Eight experts of 2h, two chosen per token."""
    return MixtralConfig(
        hidden_size=h,
        intermediate_size=2 * h,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def kind_flops(ops, kind: str) -> float:
    return sum(o.flops * o.count for o in ops if o.kind == kind)


@pytest.mark.parametrize("h,s", [(512, 1024), (1024, 256), (2304, 2048)])
def test_gpt_layer_forward_flops_are_the_closed_form(h: int, s: int) -> None:
    """Narayanan et al. (SC'21), section 5.1: a GPT layer's forward is 24Bsh^2 + 4Bs^2h."""
    counted = count_model(gpt(h=h, seq=s, heads=16), s)
    for layer in counted.layers:
        assert counted.flops("forward", layer) == pytest.approx(
            24 * s * h * h + 4 * s * s * h, rel=1e-12
        )


@pytest.mark.parametrize(
    "n,h,s,v", [(24, 2304, 2048, 51200), (4, 512, 1024, 4096), (30, 4096, 1024, 32000)]
)
def test_model_flops_are_equation_3(n: int, h: int, s: int, v: int) -> None:
    """Eq. 3 of Narayanan et al.: 72Bslh^2(1 + s/6h + V/12lh) without recompute and
    96Bslh^2(1 + s/6h + V/16lh) with it; the estimate's FLOPs are those within 1%."""
    config = gpt(h=h, layers=n, heads=16, vocab=v, seq=s)
    counted = count_model(config, s)
    no_recompute = 72 * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
    assert 3 * counted.flops("forward") == pytest.approx(no_recompute, rel=0.01)
    est = estimate(
        config,
        hardware="a100-80g",
        layout=Layout(2, microbatch_size=1, global_batch=4, seq=s, recompute=True),
    )
    with_recompute = 96 * 4 * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert est.tflops_per_gpu * 1e12 * est.step_s * 2 == pytest.approx(with_recompute, rel=0.01)
    assert est.mfu * PRESETS["a100-80g"].peak_tflops * 1e12 * est.step_s * 2 == pytest.approx(
        4 * no_recompute, rel=0.01
    )


def test_backward_splits_into_input_and_weight_gradients() -> None:
    """Matmuls: B and W each redo the forward's multiplies (one per gradient); W holds
    exactly the weights' share. Attention's backward is the flash kernel's 2.5 forwards."""
    counted = count_model(llama(), 512)
    for layer in counted.layers:
        f = kind_flops(layer.forward, MATMUL)
        assert kind_flops(layer.backward, MATMUL) == pytest.approx(f)
        assert kind_flops(layer.weight, MATMUL) == pytest.approx(f)
        assert kind_flops(layer.weight, ATTENTION) == 0
        assert kind_flops(layer.forward, ATTENTION) == pytest.approx(4 * 512 * 512 * 256)
        assert kind_flops(layer.backward, ATTENTION) == pytest.approx(
            2.5 * kind_flops(layer.forward, ATTENTION)
        )


def test_parameters_are_the_models() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    for config in (gpt(layers=3), llama(layers=3)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # as transformers 5.0 does only off the meta device
        counted = count_model(config, 128)
        assert counted.params == sum(p.numel() for p in model.parameters())
        assert counted.tied_params == (
            config.vocab_size * 512 if config.model_type == "gpt2" else 0
        )


def test_experts_are_counted_with_their_routing() -> None:
    config = mixtral(h=128, layers=2, vocab=256)
    counted = count_model(config, 64)
    layer = counted.layers[0]
    assert layer.experts == 8
    assert layer.expert_params == 8 * 3 * 128 * 256
    # each token meets 2 experts' three matrices: 2 * 3 * (2 * 128 * 256) FLOPs a token
    experts = 64 * 2 * 3 * 2 * 128 * 256
    attention_linear = 64 * 2 * (128 * 128 * 2 + 128 * 64 * 2)
    router = 64 * 2 * 128 * 8
    assert kind_flops(layer.weight, MATMUL) == pytest.approx(experts + attention_linear + router)
    assert layer.routed_bytes == 64 * 2 * 128 * 2  # each token twice, bf16


def parts_gb(est, rank: int = 0) -> dict[str, float]:
    return est.memory_parts[rank]


def rank_params(config, layout: Layout, rank: int) -> float:
    """Parameters of a rank's parts, from the count (split by tp)."""
    counted = count_model(config, layout.seq, layout.dtype)
    est = estimate(config, hardware="h100-sxm", layout=layout)
    sizes = list(est.balance)
    start = sum(sizes[:rank])
    parts = list(counted.layers[start : start + sizes[rank]])
    if rank == 0:
        parts.insert(0, counted.parts[0])
    if rank == layout.pp - 1:
        parts.append(counted.parts[-1])
    return sum(p.params for p in parts) / layout.tp, sum(p.param_tensors for p in parts)


@pytest.mark.parametrize(
    "dtype,fsdp,weights,grads,states",
    [
        (
            "bf16",
            False,
            2,
            4,
            12,
        ),  # Megatron's mixed precision: bf16 weights, fp32 grads, master + m + v
        ("fp32", False, 4, 4, 8),
        ("bf16", True, 4, 4, 8),  # FSDP: fp32 shards of all three over dp
    ],
)
def test_model_state_bytes_per_parameter(
    dtype: str, fsdp: bool, weights: int, grads: int, states: int
) -> None:
    config = llama()
    layout = Layout(2, tp=2, dp=4, fsdp=fsdp, global_batch=16, seq=256, dtype=dtype)
    est = estimate(config, hardware="h100-sxm", layout=layout)
    shard = 4 if fsdp else 1
    for rank in range(2):
        params, tensors = rank_params(config, layout, rank)
        got = parts_gb(est, rank)
        assert got["parameters"] * 1e9 == pytest.approx(weights * params / shard, rel=1e-12)
        assert got["gradients"] * 1e9 == pytest.approx(grads * params / shard, rel=1e-12)
        assert got["optimizer"] * 1e9 == pytest.approx(
            states * params / shard + 4 * tensors, rel=1e-12
        )
        if fsdp:  # the rank's bf16 weights gathered and their gradients unsharded, for the step
            assert got["buffers"] * 1e9 >= 4 * params
    sgd = estimate(
        config,
        hardware="h100-sxm",
        layout=Layout(2, global_batch=16, seq=256, dtype="fp32", optimizer="sgd"),
    )
    assert parts_gb(sgd)["optimizer"] == 0


def test_activations_follow_the_schedule_and_recompute() -> None:
    """The first rank of 1F1B holds pp micro-batches, GPipe all of them (both with one
    backward's temporaries on top); recompute keeps a layer's input only; micro-batches
    twice the size hold twice as much."""
    config = llama()
    base = dict(global_batch=16, seq=256)
    one = estimate(config, hardware="h100-sxm", layout=Layout(4, schedule="1f1b", **base))
    gpipe = estimate(config, hardware="h100-sxm", layout=Layout(4, schedule="gpipe", **base))
    counted = count_model(config, 256)
    first = [counted.parts[0], *counted.layers[: one.balance[0]]]
    per_microbatch = sum(p.saved_bytes for p in first) / 1e9
    assert parts_gb(gpipe)["activations"] - parts_gb(one)["activations"] == pytest.approx(
        (16 - 4) * per_microbatch
    )
    assert parts_gb(one, 3)["activations"] < parts_gb(one, 0)["activations"]
    double = estimate(config, hardware="h100-sxm", layout=Layout(4, microbatch_size=2, **base))
    assert parts_gb(double)["activations"] == pytest.approx(2 * parts_gb(one)["activations"])
    again = estimate(config, hardware="h100-sxm", layout=Layout(4, recompute="layer", **base))
    # (its exact count: test_estimate_mesh.py::test_a_recomputed_layer_keeps_its_input_split_by_tp)
    assert parts_gb(again, 1)["activations"] < parts_gb(one, 1)["activations"] / 2
    assert again.step_s > one.step_s
    assert again.tflops_per_gpu > one.tflops_per_gpu  # it executes the layers' forward twice
    assert again.mfu < one.mfu  # but the model's FLOPs do not grow


def test_the_step_is_the_simulated_schedule() -> None:
    """More micro-batches shrink 1F1B's bubble; zero-bubble schedules beat 1F1B at pp 4."""
    config = llama()
    few = estimate(config, hardware="a100-80g", layout=Layout(4, global_batch=4, seq=512))
    many = estimate(config, hardware="a100-80g", layout=Layout(4, global_batch=32, seq=512))
    assert many.bubble < few.bubble
    assert many.tokens_per_s_per_gpu > few.tokens_per_s_per_gpu
    zb = estimate(
        config, hardware="a100-80g", layout=Layout(4, schedule="zb-h1", global_batch=8, seq=512)
    )
    plain = estimate(config, hardware="a100-80g", layout=Layout(4, global_batch=8, seq=512))
    assert zb.bubble < plain.bubble and zb.step_s < plain.step_s
    assert len(zb.stage_times) == 4 and all(f > 0 and b > 0 and w > 0 for f, b, w in zb.stage_times)


def test_faster_hardware_is_faster_and_more_memory_changes_no_time() -> None:
    config = llama()
    layout = Layout(2, tp=2, dp=2, global_batch=8, seq=512)
    a100 = estimate(config, hardware="a100-80g", layout=layout)
    h100 = estimate(config, hardware="h100-sxm", layout=layout)
    h200 = estimate(config, hardware="h200", layout=layout)
    assert h100.step_s < a100.step_s
    assert h200.step_s <= h100.step_s
    bigger = dataclasses.replace(PRESETS["h100-sxm"], hbm_gb=1000)
    assert estimate(config, hardware=bigger, layout=layout).step_s == h100.step_s
    assert h100.memory_gb == h200.memory_gb


def test_collectives_follow_nccl_cost_model() -> None:
    hw = PRESETS["h100-sxm"]
    assert all_reduce(hw, 1e9, 1) == 0
    inside, across = all_reduce(hw, 1e9, 8), all_reduce(hw, 1e9, 16)
    assert across > inside  # the network is slower than NVLink
    # ring: 2(n-1)/n of the bytes at 0.8 of 450 GB/s, plus 8.4 us and 3.4 us per step
    assert inside == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * 1e9 / (0.8 * 450e9))
    assert all_gather(hw, 1e9, 8) == pytest.approx(inside / 2, rel=0.02)
    assert p2p(hw, 0, True) < p2p(hw, 0, False)
    assert math.isclose(p2p(hw, 4e8, True) - p2p(hw, 0, True), 4e8 / (0.8 * 450e9))


def test_bad_hardware_and_layouts_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown hardware 'b300'; use one of a100-80g"):
        estimate(llama(), hardware="b300", layout=Layout(2, global_batch=4, seq=64))
    with pytest.raises(ConfigError, match="Hardware hbm_gb must be a number > 0"):
        Hardware(989, 0, 3350, 8, 450, 50)
    with pytest.raises(ConfigError, match="make it a multiple of 8"):
        Layout(2, dp=4, microbatch_size=2, global_batch=12, seq=64)
    with pytest.raises(ConfigError, match="ep=3 must divide dp=4"):
        Layout(2, dp=4, ep=3, global_batch=8, seq=64)
    with pytest.raises(ConfigError, match="schedule 'zb' is not one of"):
        Layout(2, schedule="zb", global_batch=8, seq=64)
    with pytest.raises(ConfigError, match="use at most 10 stages"):
        estimate(llama(), hardware="h200", layout=Layout(6, chunks=2, global_batch=12, seq=64))
    with pytest.raises(ConfigError, match="pass a transformers config"):
        estimate(object(), hardware="h200", layout=Layout(2, global_batch=4, seq=64))


def test_ranking_puts_fitting_layouts_first_and_more_memory_never_slows_the_best() -> None:
    config = llama(layers=8, h=512)
    args = dict(hardware="a100-80g", gpus=4, seq=1024, global_batch=16)
    everything = rank_layouts(config, **args, memory_limit_gb=1e6)
    assert all(r.fits for r in everything)
    speeds = [r.estimate.tokens_per_s_per_gpu for r in everything]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.layout.gpus == 4 for r in everything)
    assert {r.layout.cp for r in everything} == {1, 2, 4}
    assert {r.layout.fsdp for r in everything} == {False, True, "reshard"}
    # what the search shares among layouts changes none of their predictions
    for r in everything[:: max(1, len(everything) // 6)]:
        alone = estimate(config, hardware="a100-80g", layout=r.layout)
        assert (alone.step_s, alone.memory_gb) == (r.estimate.step_s, r.estimate.memory_gb)
    assert {r.layout.schedule for r in everything} >= {"1f1b", "interleaved-1f1b", "zb-h1", "zbv"}
    memories = sorted({r.estimate.memory_gb for r in everything})
    best = []
    for limit in [*memories[:: max(1, len(memories) // 5)], memories[-1]]:
        ranked = rank_layouts(config, **args, memory_limit_gb=limit)
        first = ranked[0]
        assert first.fits and first.estimate.memory_gb <= limit
        assert [r.fits for r in ranked] == sorted((r.fits for r in ranked), reverse=True)
        best.append(first.estimate.tokens_per_s_per_gpu)
    assert best == sorted(best)  # a larger limit never ranks a slower layout first
    assert best[-1] == speeds[0]


def test_no_layout_fits_puts_none_first_that_fits() -> None:
    ranked = rank_layouts(
        llama(), hardware="a100-80g", gpus=4, seq=512, global_batch=8, memory_limit_gb=1e-6
    )
    assert not any(r.fits for r in ranked)
    with pytest.raises(ConfigError, match="no layout of 64 GPUs can run a global batch of 1"):
        rank_layouts(llama(layers=2), hardware="a100-80g", gpus=64, seq=512, global_batch=1)


def test_the_roofline_and_attention_rates() -> None:
    a100 = PRESETS["a100-80g"]
    launch = 0.9e-6  # NVIDIA's CUDA Graphs post: 3.8 us a kernel back to back, 2.9 running
    assert a100.matmul_seconds(1e15, 1e6) == pytest.approx(1e15 / 271.2e12 + launch)
    assert a100.matmul_seconds(1e9, 1e12) == pytest.approx(1e12 / (0.84 * 2039e9) + launch)
    # FlashAttention-2 on A100, causal, 8k tokens: 182 TFLOP/s counting half the scores
    assert a100.attention_seconds(1e15, 0, 8192, causal=True) == pytest.approx(
        0.5e15 / 182e12 + launch
    )
    assert a100.attention_seconds(1e15, 0, 8192, causal=False) == pytest.approx(
        1e15 / 201e12 + launch
    )
    between = a100.attention_seconds(1e15, 0, 3000, causal=False)
    assert 1e15 / 196e12 < between < 1e15 / 187e12


def test_a_multiply_runs_in_whole_waves_of_tiles() -> None:
    """256 x 128 tiles over an A100's 108 multiprocessors: 1024 tokens x 5120 outputs are
    4 x 40 = 160 tiles, two waves (216 tiles' time); 8192 x 5120 are 32 x 40 = 1280 tiles
    in 12 waves (1296): quantization costs 35% on the first, 1% on the second."""
    a100 = PRESETS["a100-80g"]
    mamf = 271.2e12
    k = 5120
    small = a100.matmul_seconds(2 * 1024 * 5120 * k, 0, (1, 1024, 5120, k)) - 0.9e-6
    assert small == pytest.approx(216 * 2 * 256 * 128 * k / mamf)
    assert small / (2 * 1024 * 5120 * k / mamf) == pytest.approx(216 / 160)
    large = a100.matmul_seconds(2 * 8192 * 5120 * k, 0, (1, 8192, 5120, k)) - 0.9e-6
    assert large == pytest.approx(12 * 108 * 2 * 256 * 128 * k / mamf)
    plain = dataclasses.replace(a100, sms=0)  # no wave model: every multiply at MAMF
    assert plain.matmul_seconds(2 * 1024 * 5120 * k, 0, (1, 1024, 5120, k)) - 0.9e-6 == (
        pytest.approx(2 * 1024 * 5120 * k / mamf)
    )


def test_stages_hold_the_embeddings_and_head_as_a_layer_each() -> None:
    est = estimate(llama(layers=6), hardware="h200", layout=Layout(4, global_batch=8, seq=64))
    assert est.balance == (1, 2, 2, 1)
    est = estimate(
        llama(layers=8),
        hardware="h200",
        layout=Layout(2, chunks=2, schedule="interleaved-1f1b", global_batch=8, seq=64),
    )
    assert sum(est.balance) == 8 and len(est.balance) == 4


def test_tensor_and_expert_parallelism_and_the_network_cost_what_they_should() -> None:
    config = llama()
    one = estimate(config, hardware="h100-sxm", layout=Layout(2, global_batch=8, seq=512))
    two = estimate(config, hardware="h100-sxm", layout=Layout(2, tp=2, global_batch=8, seq=512))
    assert parts_gb(two)["activations"] == pytest.approx(parts_gb(one)["activations"] / 2)
    assert parts_gb(two)["parameters"] < parts_gb(one)["parameters"]
    far = dataclasses.replace(PRESETS["h100-sxm"], gpus_per_node=1)  # all on the network
    assert (
        estimate(config, hardware=far, layout=Layout(2, global_batch=8, seq=512)).step_s
        > one.step_s
    )
    moe = mixtral(h=256, layers=4, vocab=1024)
    alone = estimate(moe, hardware="h100-sxm", layout=Layout(2, dp=2, global_batch=8, seq=512))
    spread = estimate(
        moe, hardware="h100-sxm", layout=Layout(2, dp=2, ep=2, global_batch=8, seq=512)
    )
    assert spread.step_s > alone.step_s  # the all-to-alls
    assert parts_gb(spread)["parameters"] < parts_gb(alone)["parameters"]  # half the experts


def test_layers_alike_are_traced_twice_and_counted_from_the_second() -> None:
    """The first layer also saves what all layers share (the rotary tables); the rest are
    the second's counts."""
    counted = count_model(llama(layers=6), 256)
    first, second, *rest = counted.layers
    assert first.saved_bytes > second.saved_bytes
    assert all(layer is second for layer in rest)


def test_a_model_built_on_meta_is_estimated_as_its_config() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import conveyor

    config = llama(layers=4)
    with conveyor.empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    layout = Layout(2, tp=2, global_batch=8, seq=256)
    from_model = estimate(model, hardware="h200", layout=layout)
    from_config = estimate(config, hardware="h200", layout=layout)
    assert from_model.step_s == pytest.approx(from_config.step_s)
    for ours, theirs in zip(from_model.memory_parts, from_config.memory_parts, strict=True):
        assert ours == pytest.approx(theirs)
    assert all(p.is_meta for p in model.parameters())  # the model itself is left as it was
    with pytest.raises(ConfigError, match="count a model on the meta device"):
        estimate(torch.nn.Linear(2, 2), hardware="h200", layout=layout)
