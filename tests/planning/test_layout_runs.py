"""The Layout fields that express the runs people publish, each against a hand computation:
the split, the distributed optimizer, FSDP resharded after every use, gradient reduction
overlapped with the backward, sequence parallelism off, selective recompute, context
parallelism; and models whose attention is written by hand (BLOOM)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
from transformers import BloomConfig, LlamaConfig

from conveyor.errors import ConfigError
from conveyor.planning import PRESETS, Layout, estimate
from conveyor.planning.collectives import all_gather, all_reduce
from conveyor.planning.counted import counted_costs
from conveyor.planning.counting import count_model
from conveyor.planning.model_count import ATTENTION, MATMUL

H100 = PRESETS["h100-sxm"]
LAYER, EMBEDDINGS, HEAD = 983_552, 262_144, 262_400  # test_estimate_mesh.llama()'s parts
GB = 1e9


def llama(layers: int = 8) -> LlamaConfig:
    """h 256, 8 heads (4 key/value), MLP 1024, vocabulary 1024, untied."""
    return LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
    )  # fmt: skip


def test_an_even_split_places_the_embeddings_and_the_head_on_the_end_stages() -> None:
    """8 layers on 4 stages: "even" gives 2 each, the embeddings on the first stage and the
    head on the last (Megatron-LM); "ends" counts those as a layer each (1, 3, 3, 1); a
    tuple is taken as it is."""
    base = dict(global_batch=8, seq=64, dtype="fp32", optimizer="sgd")
    even = estimate(llama(), hardware=H100, layout=Layout(4, balance="even", **base))
    assert even.balance == (2, 2, 2, 2)
    # fp32 weights: 4 bytes a parameter
    assert even.memory_parts[0]["parameters"] * GB == pytest.approx(4 * (2 * LAYER + EMBEDDINGS))
    assert even.memory_parts[1]["parameters"] * GB == pytest.approx(4 * 2 * LAYER)
    assert even.memory_parts[3]["parameters"] * GB == pytest.approx(4 * (2 * LAYER + HEAD))
    # a head 64 times a layer's parameters: balanced by time its stage holds fewer layers,
    # split evenly it holds as many
    wide = llama()
    wide.vocab_size = 65536
    assert estimate(wide, hardware=H100, layout=Layout(4, **base)).balance != (2, 2, 2, 2)
    timed = estimate(wide, hardware=H100, layout=Layout(4, balance="even", **base))
    assert timed.balance == (2, 2, 2, 2)
    ends = estimate(llama(), hardware=H100, layout=Layout(4, balance="ends", **base))
    assert ends.balance == (1, 3, 3, 1)
    given = estimate(llama(), hardware=H100, layout=Layout(4, balance=(3, 2, 2, 1), **base))
    assert given.balance == (3, 2, 2, 1)
    assert given.memory_parts[0]["parameters"] * GB == pytest.approx(4 * (3 * LAYER + EMBEDDINGS))
    with pytest.raises(ConfigError, match="must add up to the model's 8 decoder layers"):
        estimate(llama(), hardware=H100, layout=Layout(4, balance=(3, 2, 2, 2), **base))
    with pytest.raises(ConfigError, match="must give the decoder layers of each of the 4"):
        Layout(4, balance=(4, 4), **base)


def test_the_distributed_optimizer_shards_master_weights_and_states_over_dp() -> None:
    """Megatron's mixed precision keeps bf16 weights (2 bytes), fp32 gradients (4), and an
    fp32 master copy with AdamW's two states (12); the distributed optimizer divides the
    12 by dp: 6 + 12/dp bytes a parameter (Megatron-LM's distributed optimizer guide)."""
    base = dict(pp=2, tp=2, dp=4, global_batch=16, seq=64, balance="even")
    plain = estimate(llama(), hardware=H100, layout=Layout(**base))
    zero = estimate(llama(), hardware=H100, layout=Layout(**base, distributed_optimizer=True))
    params = (4 * LAYER + EMBEDDINGS) / 2  # rank 0, split by tp 2
    tensors = 4 * 9 + 1  # a layer's 9 weight tensors, the embedding's one: a step count each
    assert plain.memory_parts[0]["optimizer"] * GB == pytest.approx(12 * params + 4 * tensors)
    assert zero.memory_parts[0]["optimizer"] * GB == pytest.approx(12 * params / 4 + 4 * tensors)
    for kind in ("parameters", "gradients", "activations", "buffers"):
        assert zero.memory_parts[0][kind] == plain.memory_parts[0][kind], kind
    with pytest.raises(ConfigError, match="fsdp already shards the optimizer state"):
        Layout(**base, fsdp=True, distributed_optimizer=True)


def test_fsdp_resharded_after_every_use_holds_two_units_not_the_stage() -> None:
    """fsdp=True keeps the rank's bf16 weights gathered and their gradients unsharded for
    the step (2 x 2 bytes x the rank's parameters); "reshard" only a unit in use and the
    next prefetched, each with its gradient (2 x 2 x 2 bytes x the largest unit). Both
    shard the fp32 weights, gradients and states over dp (16 bytes a parameter / dp)."""
    base = dict(pp=2, dp=4, global_batch=16, seq=64, balance="even", schedule="1f1b")
    once = estimate(llama(), hardware=H100, layout=Layout(**base, fsdp=True))
    each = estimate(llama(), hardware=H100, layout=Layout(**base, fsdp="reshard"))
    send = 2 * 256 * 2 * 64  # one micro-batch's hidden states sent, one received (bf16)
    params = 4 * LAYER + EMBEDDINGS
    assert once.memory_parts[0]["buffers"] * GB == pytest.approx(send + 2 * 2 * params)
    assert each.memory_parts[0]["buffers"] * GB == pytest.approx(send + 2 * 2 * 2 * LAYER)
    for est in (once, each):
        state = est.memory_parts[0]
        total = state["parameters"] + state["gradients"] + state["optimizer"]
        assert total * GB == pytest.approx(16 * params / 4 + 4 * (4 * 9 + 1))
    # On a network so slow that gathering a unit outlasts its compute, "reshard"'s F of a
    # stage is the gathers of its units, one per use (each beside the unit's compute).
    slow = dataclasses.replace(H100, gpus_per_node=1, inter_node_gbps=1e-3)
    each = estimate(llama(), hardware=slow, layout=Layout(**base, fsdp="reshard"))
    group = Layout(**base).group("dp")
    gathers = all_gather(slow, 2 * EMBEDDINGS, *group) + 4 * all_gather(slow, 2 * LAYER, *group)
    assert each.stage_times[0][0] == pytest.approx(gathers, rel=1e-9)


def test_gradient_reduction_overlapped_with_the_last_backward_is_hidden() -> None:
    """pp 1, dp 2 over two nodes (tp 8 makes the replicas a node apart): a 4-byte
    all-reduce of the rank's gradients. After the step ("none") it is all exposed; beside
    the last backward ("backward") only what outlasts that backward."""
    base = dict(pp=1, tp=8, dp=2, global_batch=4, seq=512, balance="even")
    config = LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
    )  # fmt: skip
    after = estimate(config, hardware=H100, layout=Layout(**base, dp_overlap="none"))
    beside = estimate(config, hardware=H100, layout=Layout(**base, dp_overlap="backward"))
    params = sum(p.params for p in count_model(config, 512).parts) / 8
    reduce = all_reduce(H100, 4 * params, *Layout(**base).group("dp"))
    update = after.sync_s - reduce
    assert update > 0
    last_backward = sum(b for _, b, _ in after.stage_times)  # one rank, one stage
    exposed = max(0.0, reduce - last_backward)
    assert beside.sync_s == pytest.approx(exposed + update, rel=1e-9)
    assert beside.step_s < after.step_s


def test_sequence_parallelism_off_keeps_the_hidden_wide_activations_whole() -> None:
    """Without sequence parallelism the saved tensors as wide as the hidden states (norm
    inputs, residuals) are on every tp rank whole; the rest is split by tp either way."""
    config = llama(layers=4)
    base = dict(pp=1, tp=4, global_batch=2, seq=128, balance="even")
    on = estimate(config, hardware=H100, layout=Layout(**base))
    off = estimate(config, hardware=H100, layout=Layout(**base, sequence_parallel=False))
    counted = count_model(config, 128)
    wide = sum(p.saved_hidden for p in counted.parts)
    assert 0 < wide < sum(p.saved_bytes for p in counted.parts)
    held = 1  # one micro-batch in flight on one stage
    extra = held * wide * (1 - 1 / 4)
    assert (off.memory_parts[0]["activations"] - on.memory_parts[0]["activations"]) * GB == (
        pytest.approx(extra, rel=1e-6)
    )


def test_selective_recompute_runs_the_attention_again_at_b() -> None:
    """ "selective" charges each B its layers' attention forward; "layer" their whole
    forward; the step grows by those over the schedule, never by more than B does."""
    base = dict(pp=1, global_batch=4, seq=1024, balance="even")
    plain = estimate(llama(layers=4), hardware=H100, layout=Layout(**base))
    layout = Layout(**base, recompute="selective")
    selective = estimate(llama(layers=4), hardware=H100, layout=layout)
    counted = count_model(llama(layers=4), 1024)
    attention = sum(
        H100.op_seconds(o, 1, 1, 1024)
        for layer in counted.layers
        for o in layer.forward
        if o.kind == ATTENTION
    )
    (f0, b0, w0), (f1, b1, w1) = plain.stage_times[0], selective.stage_times[0]
    assert (f1, w1) == (f0, w0)
    assert b1 - b0 == pytest.approx(attention, rel=1e-9)
    # Memory: F keeps all but the attention kernels' tensors; the B that runs them again
    # holds one layer's at a time (one rank, F and B alternate: one micro-batch held).
    units = counted_costs(counted, H100, layout).layers
    kernels = [u.attention_saved for u in units if u.kind == "layer"]
    assert max(kernels) > 0
    saving = plain.memory_parts[0]["activations"] - selective.memory_parts[0]["activations"]
    assert saving * GB == pytest.approx(sum(kernels) - max(kernels), rel=1e-6)


def test_context_parallelism_splits_the_sequence_and_reduces_over_dp_times_cp() -> None:
    """cp 2: each rank holds two of four chunks of every sequence (half its tokens): half
    the activations, the attention FLOPs balanced; cp ranks are tp apart (conveyor.init's
    ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank); the step's tokens are per
    GPU over pp * tp * cp * dp."""
    config = llama(layers=4)
    base = dict(pp=2, tp=2, global_batch=4, seq=1024, balance="even")
    one = estimate(config, hardware=H100, layout=Layout(**base))
    two = estimate(config, hardware=H100, layout=Layout(**base, cp=2))
    layout = Layout(2, tp=2, cp=2, dp=2, global_batch=8, seq=1024)
    assert layout.group("cp") == (2, 2) and layout.group("pp") == (2, 4)
    assert layout.group("dp") == (2, 8) and layout.gpus == 16
    assert two.memory_parts[1]["activations"] == pytest.approx(
        one.memory_parts[1]["activations"] / 2, rel=1e-6
    )
    for kind in ("parameters", "gradients", "optimizer"):
        assert two.memory_parts[0][kind] == one.memory_parts[0][kind]
    assert two.step_s < one.step_s
    with pytest.raises(ConfigError, match="cuts each sequence into 8 equal chunks"):
        Layout(2, cp=4, global_batch=4, seq=1020)


def test_bloom_is_estimated_with_its_alibi_attention_as_the_fused_kernel() -> None:
    """BLOOM writes its attention by hand (scores by baddbmm with the ALiBi bias, a softmax,
    a bmm with the values); it is counted as the flash kernel a GPU runs it with: the
    same 4 s^2 h FLOPs of a causal attention in F, 2.5 times that in B, and no
    sequence x sequence scores saved. Counted as written ("math") the scores are saved."""
    s, h, heads = 256, 256, 8
    config = BloomConfig(hidden_size=h, n_layer=2, n_head=heads, vocab_size=1024)
    est = estimate(config, hardware=H100, layout=Layout(1, global_batch=2, seq=s))
    assert est.step_s > 0
    counted = count_model(config, s)
    layer = counted.layers[1]
    attention = [o for o in layer.forward if o.kind == ATTENTION]
    assert sum(o.flops * o.count for o in attention) == pytest.approx(4 * s * s * h)
    assert all(o.causal for o in attention)
    backward = sum(o.flops * o.count for o in layer.backward if o.kind == ATTENTION)
    assert backward == pytest.approx(2.5 * 4 * s * s * h)
    scores = heads * s * s * 2  # one bf16 copy of the scores
    # nothing saved grows with s^2: twice the tokens save twice the bytes
    assert count_model(config, 2 * s).layers[1].saved_bytes == pytest.approx(2 * layer.saved_bytes)
    written = count_model(config, s, attention="math").layers[1]
    assert written.saved_bytes - layer.saved_bytes > scores
    assert not any(o.kind == ATTENTION for o in written.forward)
    assert any(o.kind == MATMUL and o.shape[0] == heads for o in written.forward)


def test_math_attention_saves_five_bytes_a_score() -> None:
    """Megatron's core attention (Korthikanti et al. 2022, section 4.1): the softmax's
    output (2 bytes a score), the dropout's one-byte mask and its output (2): 5 a score
    more than the flash kernel's layer saves, less the kernel's log-sum-exp and its
    random-number state (its output is saved by the output projection either way)."""
    from transformers import GPT2Config

    s, h, heads = 128, 256, 4
    config = GPT2Config(n_embd=h, n_layer=2, n_head=heads, n_positions=s, vocab_size=512)
    flash = count_model(config, s).layers[1].saved_bytes
    math = count_model(config, s, attention="math").layers[1].saved_bytes
    lse = heads * s * 4  # flash's log-sum-exp (fp32); its dropout seed and offset: bytes
    assert math - flash == pytest.approx(5 * heads * s * s - lse, abs=64)


def test_wave_quantization_slows_a_stage_of_narrow_multiplies() -> None:
    """With one sequence of 1024 tokens a micro-batch, the multiplies of a 5120-wide GPT
    layer leave waves of 256 x 128 tiles part empty on an A100's 108 multiprocessors (the
    output projection's 160 tiles take 2 waves): the stage's F is slower than every
    multiply at MAMF would make it."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=5120, n_layer=2, n_head=40, n_positions=1024, vocab_size=512)
    layout = Layout(1, global_batch=1, seq=1024, balance="even")
    waves = estimate(config, hardware="a100-80g", layout=layout)
    flat = dataclasses.replace(PRESETS["a100-80g"], sms=0)
    plain = estimate(config, hardware=flat, layout=layout)
    assert waves.stage_times[0][0] > 1.1 * plain.stage_times[0][0]
    assert waves.step_s > plain.step_s
    a100 = PRESETS["a100-80g"]
    flops = 2 * 1024 * 5120 * 5120
    full = 2 * 108 * 2 * 256 * 128 * 5120 / (271.2e12)  # 2 waves of 108 full tiles
    assert a100.matmul_seconds(flops, 0, (1, 1024, 5120, 5120)) == pytest.approx(
        full + a100.launch_s, rel=1e-12
    )
    assert flat.matmul_seconds(flops, 0, (1, 1024, 5120, 5120)) == pytest.approx(
        flops / 271.2e12 + a100.launch_s, rel=1e-12
    )


def test_a_split_backward_holds_what_w_reads_and_zb_auto_is_fitted_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From B to W the runtime keeps what the weight GEMMs read (``w_inputs``, the paper's
    M_W), W_MEMORY of the activations where that is unknown; the estimate fits ``zb-auto``
    to the count's largest stage share, so that its cap holds in bytes."""
    import conveyor.planning.cluster as cluster
    from conveyor.planning.costs import UnitCost
    from conveyor.planning.memory import held_until_w, w_share
    from conveyor.schedules import zero_bubble_auto
    from conveyor.schedules.simulation import W_MEMORY

    def unit(activations: float, w_inputs: float) -> UnitCost:
        return UnitCost("u", 1.0, 1.0, 1.0, 1.0, 2.0, activations, 0.0, 0.0, w_inputs=w_inputs)

    assert held_until_w(unit(100.0, 40.0)) == 40.0
    assert held_until_w(unit(100.0, 0.0)) == pytest.approx(W_MEMORY * 100.0)
    assert w_share([[unit(100.0, 40.0)], [unit(50.0, 10.0), unit(50.0, 20.0)]]) == 0.4
    told: list[float] = []

    def spy(*args: object, w_memory: float, **kwargs: object) -> object:
        told.append(w_memory)
        return zero_bubble_auto(*args, w_memory=w_memory, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cluster, "zero_bubble_auto", spy)
    layout = Layout(4, global_batch=16, seq=64, dtype="fp32", optimizer="sgd",
                    schedule="zb-auto", microbatch_cap=4)  # fmt: skip
    estimate(llama(), hardware=H100, layout=layout)
    costs = counted_costs(count_model(llama(), seq=64, dtype="fp32"), H100, layout)
    share = max(
        sum(held_until_w(u) for u in part) / sum(u.activations for u in part)
        for part in costs.parts(cluster.unit_balance(layout, 8, costs.times(True)))
    )
    assert told == [pytest.approx(share)] and 0.2 < share < 0.95
