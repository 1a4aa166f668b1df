"""The estimate's memory against the runtime's own accounting (issue 48): a tiny Llama
(untied, an uneven split) and a tiny GPT-2 (tied embedding and head) train at pp=2 on two
gloo processes with 1F1B, the stage split of ``est.balance``, AdamW and
``track_memory=True``. Per rank, the parameters, gradients and optimizer state are the
estimate's bytes exactly; the activation peak the runtime measures (what autograd saves)
is within 10% of the estimate's walk without the temporaries of an action (which the
estimate's memory adds on top).

What is left between the activation numbers (about 2-3% here, the estimate below): the
captured graph materializes the causal mask and SDPA saves a float copy per layer (the
estimate counts the flash kernel, which takes none), rotary tables are made again and saved
on each stage, once per micro-batch (the estimate: on the first layer, per sequence), and
the flash kernel's random-number seed and offset (24 bytes per layer) do not exist on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import conveyor
from conveyor.planning import Layout, estimate, hardware
from conveyor.planning.cluster import unit_balance
from conveyor.planning.counted import counted_costs
from conveyor.planning.counting import count_model, decoder_layers
from conveyor.planning.memory import activation_peaks
from conveyor.schedules import get_schedule
from tests.support import distributed

SEQ, MICROBATCH, BATCH, VOCAB = 32, 2, 8, 256
LAYOUT = Layout(
    2, schedule="1f1b", microbatch_size=MICROBATCH, global_batch=BATCH, seq=SEQ, dtype="fp32"
)
GB = 1e9


def _config(kind: str) -> Any:
    import transformers as T

    if kind == "llama":  # 5 layers: an uneven balance
        return T.LlamaConfig(
            num_hidden_layers=5, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
            tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, attn_implementation="sdpa",
        )  # fmt: skip
    return T.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _train(rank: int, balances: dict[str, tuple[int, ...]]) -> dict[str, dict[str, Any]]:
    """Two steps of each model; this rank's bytes by kind after the second."""
    import transformers as T

    ctx = conveyor.init(pp=2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    out = {}
    for kind, balance in balances.items():
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(_config(kind))
        decoder_layers(model)[balance[0]].pipeline_stage = 1  # est.balance's split
        # Split at construction, so that the optimizer gets only this rank's parameters.
        pipe = conveyor.Pipeline(
            model,
            loss_fn=None,
            microbatches=LAYOUT.microbatches,
            schedule=LAYOUT.schedule,
            context=ctx,
            track_memory=True,
            sample=(batch, None),
        )
        params = list(pipe.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        for _ in range(2):  # the second step starts with optimizer state, as training does
            optimizer.zero_grad(set_to_none=True)
            pipe.train_step(batch, None)
            grads = _nbytes(p.grad for p in params if p.grad is not None)
            optimizer.step()
        states = (t for s in optimizer.state.values() for t in s.values())
        out[kind] = {
            "names": [name for name, _ in pipe.named_parameters()],
            "parameters": _nbytes(params),
            "gradients": grads,
            "optimizer": _nbytes(t for t in states if isinstance(t, torch.Tensor)),
            "activations": pipe.last_step_memory().peak,
        }
    return out


def _saved_peaks(config: Any) -> list[float]:
    """Per rank, the estimate's activation peak without the temporaries of an action (its
    memory walk counts them, the runtime's meter counts only what is saved)."""
    counted = count_model(config, SEQ, LAYOUT.dtype)
    costs = counted_costs(counted, hardware("h100-sxm"), LAYOUT)
    units = tuple(dataclasses.replace(u, workspace=0.0) for u in costs.layers)
    costs = dataclasses.replace(costs, layers=units)
    balance = unit_balance(LAYOUT, len(counted.layers), costs.times(True))
    schedule = get_schedule(LAYOUT.schedule, LAYOUT.pp, LAYOUT.microbatches)
    return activation_peaks(schedule, costs.parts(balance), False, False)


def _layers_named(names: list[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.split(".")[1] in ("layers", "h")}


# over 2 s: the fast lane stays under 90 s
@pytest.mark.slow
@pytest.mark.multiprocess
def test_memory_parts_equal_the_runtime_on_two_ranks() -> None:
    kinds = ("llama", "gpt2")
    estimates = {k: estimate(_config(k), hardware="h100-sxm", layout=LAYOUT) for k in kinds}
    assert estimates["llama"].balance == (3, 2)
    balances = {kind: est.balance for kind, est in estimates.items()}
    results = distributed.run(_train, 2, balances, fork=True)
    for kind, est in estimates.items():
        first = est.balance[0]
        for rank, measured in enumerate(r[kind] for r in results):
            where = (kind, rank, measured)
            held = range(first) if rank == 0 else range(first, sum(est.balance))
            assert _layers_named(measured["names"]) == set(held), where
            predicted = est.memory_parts[rank]
            for part in ("parameters", "gradients", "optimizer"):
                exact = pytest.approx(predicted[part] * GB, rel=1e-9)
                assert measured[part] == exact, (part, where)
            assert predicted["activations"] * GB > _saved_peaks(_config(kind))[rank]
            ratio = _saved_peaks(_config(kind))[rank] / measured["activations"]
            assert abs(ratio - 1) <= 0.10, (ratio, where)
            # Today within 4% (the gap is the module docstring's list); tracing with the
            # key/value cache on made GPT-2's estimate 5% high (its copies of keys and values).
            assert abs(ratio - 1) <= 0.04, (ratio, where)
    # GPT-2's tied weight: a copy on each rank, counted in both ranks' exact sums above.
    assert "transformer.wte.weight" in results[0]["gpt2"]["names"]
    assert "lm_head.weight" in results[1]["gpt2"]["names"]
