"""The counted estimate (``conveyor.planning.estimate`` against ``Hardware.measure()``)
beside conveyor's real step on this machine: a transformers Llama (8 layers of width 256,
sequence 128, fp32, SGD) trained by a ``Pipeline`` on gloo processes, one thread each.

Each layout runs with the estimate's own split (``est.balance``); the layouts alternate
round by round so the machine's drift hits all alike. Time: rank 0's fastest step between
two barriers (the other load on a shared machine only slows). Memory: per rank, the peak
of the tensors a step creates and holds (``TensorMemory``: activations, the pipeline's
buffers, the temporaries of an action; gradients are kept between steps, zeroed in
place) against the estimate's activations plus buffers.
``benchmarks/plan_accuracy.py --counted`` prints the table;
``tests/planning/test_measured_step.py`` checks some of it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import conveyor
from conveyor.observe.trace import measured_costs
from conveyor.planning import Estimate, Hardware, Layout, estimate
from conveyor.planning.counting import decoder_layers
from conveyor.planning.machine import cycling, multiply_into
from conveyor.runtime.memory import TensorMemory

SEQ, VOCAB, MICROBATCH, BATCH = 128, 512, 2, 8
LAYOUTS: dict[str, dict[str, Any]] = {
    "pp 2, 1f1b": dict(pp=2, schedule="1f1b"),
    "pp 2 x 2 chunks, interleaved": dict(pp=2, schedule="interleaved-1f1b", chunks=2),
    "pp 2, zb-h1": dict(pp=2, schedule="zb-h1"),
    "pp 2, zbv": dict(pp=2, schedule="zbv", chunks=2),
}
"""The layouts two processes can run here (name: ``Layout`` keywords)."""

NOT_RUN = {
    "pp 4 interleaved": "4 processes on this machine's 2 cores take turns, which no "
    "estimate models",
    "pp 2 x dp 2, FSDP": "4 processes (as above)",
    "pp 2 x tp 2, Llama": "4 processes (as above)",
    "Mixtral, ep 2": "4 processes (as above)",
    "vocabulary parallel": "the estimate does not count a vocabulary-parallel head yet",
}
"""The issue's layouts not measured here, and why."""


def config() -> Any:
    """The model: a transformers Llama config."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ,
        tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip


def layout(name: str) -> Layout:
    """The named layout at this check's batch."""
    return Layout(
        **LAYOUTS[name], microbatch_size=MICROBATCH, global_batch=BATCH, seq=SEQ,
        dtype="fp32", optimizer="sgd",
    )  # fmt: skip


def predict(hw: Hardware, names: list[str]) -> dict[str, Estimate]:
    """Each named layout estimated on ``hw``."""
    return {name: estimate(config(), hardware=hw, layout=layout(name)) for name in names}


def _pipeline(name: str, balance: tuple[int, ...], ctx: Any, batch: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config())
    layers, first = decoder_layers(model), 0
    for stage, count in enumerate(balance[:-1], 1):  # the estimate's split
        first += count
        layers[first].pipeline_stage = stage
    lay = layout(name)
    return conveyor.Pipeline(
        model, loss_fn=None, microbatches=lay.microbatches, schedule=lay.schedule,
        chunks=lay.chunks, context=ctx, sample=(batch, None),
    )  # fmt: skip


def measure(
    rank: int | None,
    balances: dict[str, tuple[int, ...]],
    rounds: int,
    steps: int,
    warmup: int,
) -> dict[str, dict[str, Any]]:
    """On each of two ranks (``rank`` unused: ``conveyor.init`` reads it from the
    environment): every layout's step times, this rank's memory peak, and the probe's
    time (:func:`slowdown`)."""
    ctx = conveyor.init(pp=2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    steps_of, pipes = {}, {}
    out: dict[str, dict[str, Any]] = {}
    for name, balance in balances.items():
        pipe = _pipeline(name, balance, ctx, batch)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-4)

        def step(pipe: Any = pipe, opt: Any = opt) -> None:
            pipe.train_step(batch, None)
            opt.step()
            opt.zero_grad(set_to_none=False)

        for _ in range(warmup):
            step()
        with TensorMemory() as meter:
            step()
        steps_of[name] = step
        pipes[name] = pipe
        out[name] = {"times": [], "memory": meter.peak, "actions": None}
    probes: list[float] = []
    for r in range(rounds):
        names = list(balances) if r % 2 == 0 else list(balances)[::-1]
        probes += _probe()
        for name in names:
            for _ in range(steps):
                dist.barrier()
                t0, cpu0 = _now(), time.process_time()
                steps_of[name]()
                cpu = time.process_time() - cpu0
                dist.barrier()
                took = _now() - t0
                if not out[name]["times"] or took < min(out[name]["times"]):
                    out[name]["actions"] = _actions(pipes[name], len(balances[name]))
                    out[name]["cpu"] = cpu
                out[name]["times"].append(took)
    probes += _probe()
    for entry in out.values():  # the best seen: a shared machine's other load only slows
        entry["step"] = min(entry["times"])
    out["probe"] = {"seconds": min(probes)}
    return out


def _actions(pipe: Any, stages: int) -> list[tuple[float, float, float]]:
    """Per stage, this rank's mean F, B and W seconds in the pipeline's last step (0 for
    another rank's stages)."""
    return measured_costs(pipe.last_step_timings(), stages)


PROBE = (256, 1024, 1024)
"""The multiply both ranks time at once between rounds: (m, n, k)."""


def _probe(calls: int = 20) -> list[float]:
    """Seconds of one :data:`PROBE` multiply, timed on every rank at once: the share of a
    core each rank gets while both run (on a shared machine, less than alone)."""
    m, n, k = PROBE
    # operands cycled beyond the cache, as Hardware.measure() times them
    call = cycling(multiply_into, lambda: [torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)])
    dist.barrier()
    times = []
    for _ in range(calls):
        t0 = _now()
        call()
        times.append(_now() - t0)
    return times


def slowdown(hw: Hardware, results: list[dict[str, dict[str, Any]]]) -> float:
    """How much slower the probe ran on the ranks, side by side, than ``hw`` says: what
    the machine's other load took from them while they ran."""
    m, n, k = PROBE
    alone = hw.matmul_seconds(2 * m * n * k, 4 * (m * k + k * n + m * n), (1, m, n, k))
    return max(r["probe"]["seconds"] for r in results) / alone


def _now() -> float:
    return time.perf_counter()


def predicted_memory(est: Estimate, rank: int) -> float:
    """Bytes the estimate says a step's new tensors reach at their peak on ``rank``."""
    parts = est.memory_parts[rank]
    return (parts["activations"] + parts["buffers"]) * 1e9


def table(
    estimates: dict[str, Estimate],
    results: list[dict[str, dict[str, Any]]],
    slow: float,
    with_not_run: bool = True,
) -> str:
    """Predicted beside measured, per layout (time: rank 0's fastest step; predicted alone
    and times ``slow``, :func:`slowdown`)."""
    rows = [
        f"| layout | step ms: predicted / x {slow:.2f} / measured | memory MB rank 0 "
        "| memory MB rank 1 |",
        "|---|---|---|---|",
    ]
    for name, est in estimates.items():
        step, scaled = results[0][name]["step"], est.step_s * slow
        times = f"{est.step_s * 1e3:.0f} / {scaled * 1e3:.0f} / {step * 1e3:.0f}"
        cells = [f"{times} ({scaled / step - 1:+.0%})"]
        for rank in range(2):
            ours, real = predicted_memory(est, rank), results[rank][name]["memory"]
            cells.append(f"{ours / 1e6:.1f} / {real / 1e6:.1f} ({ours / real - 1:+.0%})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, why in NOT_RUN.items() if with_not_run else ():
        rows.append(f"| {name} | not measured: {why} | - | - |")
    return "\n".join(rows)


def stage_table(estimates: dict[str, Estimate], results: list[dict[str, dict[str, Any]]]) -> str:
    """Per layout and stage, the estimate's F, B and W of one micro-batch (the runtime's
    cost per action included) beside the mean of each in rank 0's fastest step (its
    stages' ranks' records), and each rank's CPU seconds in that step: what a layout's
    miss is made of, and whether other load stretched the step (wall over CPU)."""
    rows = ["| layout | stage | F ms | B ms | W ms |", "|---|---|---|---|---|"]
    for name, est in estimates.items():
        for s, ours in enumerate(est.stage_times):
            real = [max(r[name]["actions"][s][k] for r in results) for k in range(3)]
            pairs = zip(ours, real, strict=True)
            cells = [f"{o * 1e3:.1f} / {m * 1e3:.1f}" if m else "-" for o, m in pairs]
            rows.append(f"| {name} | {s} | " + " | ".join(cells) + " |")
        cpu = " / ".join(f"{r[name]['cpu'] * 1e3:.0f}" for r in results)
        rows.append(f"| {name} | step | wall {results[0][name]['step'] * 1e3:.0f} ms, CPU per "
                    f"rank {cpu} ms | | |")  # fmt: skip
    return "\n".join(rows)
