"""The tensor-parallel half of ``vs_torch.py --model llama-tp``: a transformers Llama (4
decoder layers of width 256, 8 heads, 4 key/value heads, vocabulary 1024, sequence 128,
built from its config) on pp 2 x tp 2 = 4 processes (gloo, one thread each), batch 16 in 8
micro-batches, next-token cross-entropy, SGD.

conveyor gets the model as it is, ``tp_plan="auto"`` (the model's own
``base_model_tp_plan``: attention and MLP projections column- / row-wise) and splits it
itself (captured with torch.export, cut between layers 1 and 2).
``torch.distributed.pipelining`` gets it as torchtitan builds a Llama stage by hand: each
rank keeps its two decoder layers in a stage module of its own (the first with the
embedding, the last with the norm and the output layer), the same projections
parallelized with ``parallelize_module`` over the tp ranks of a ``(pp, tp)`` device mesh,
and ``Schedule1F1B``. Both runs alternate round by round in the same processes.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import alternate
from torch import Tensor, nn

import conveyor

LAYERS, WIDTH, HEADS, KV_HEADS, VOCAB = 4, 256, 8, 4, 1024
SEQUENCE, BATCH, MICROBATCHES = 128, 16, 8
PP, TP = 2, 2
PROCS = PP * TP
Step = Callable[[], None]


def build_llama() -> nn.Module:
    """The benchmark transformer, identical on every call and every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQUENCE, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    """Cross-entropy of the logits (torch's last stage returns them bare, conveyor's the
    model's own output object)."""
    logits = out if isinstance(out, Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def styles() -> dict[str, Any]:
    """The Llama's own tensor-parallel plan as torch ParallelStyles (relative to a layer)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    return {
        "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
        "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
        "mlp.down_proj": row,
    }  # fmt: skip


class LlamaStage(nn.Module):
    """One pipeline rank's share of the Llama, as torchtitan cuts one: its decoder layers,
    with the embedding on the first and the norm and output layer on the last."""

    def __init__(self, model: Any, first: int, last: int, rank: int) -> None:
        super().__init__()
        self.embed = model.model.embed_tokens if rank == 0 else None
        self.layers = nn.ModuleList(model.model.layers[first:last])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if rank == PP - 1 else None
        self.head = model.lm_head if rank == PP - 1 else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device)[None]
        rotary = self.rotary(h, positions)
        for layer in self.layers:  # no mask: sdpa's causal attention
            h = layer(h, attention_mask=None, position_embeddings=rotary)
        if self.head is not None:
            assert self.norm is not None
            h = self.head(self.norm(h))
        return h


def torch_step(x: Tensor, y: Tensor, mesh: Any, losses: list[float]) -> Step:
    from torch.distributed import pipelining
    from torch.distributed.tensor.parallel import parallelize_module

    pp_rank = mesh["pp"].get_local_rank()
    per = LAYERS // PP
    stage_module = LlamaStage(build_llama(), pp_rank * per, (pp_rank + 1) * per, pp_rank)
    for layer in stage_module.layers:
        parallelize_module(layer, mesh["tp"], styles())
    stage = pipelining.PipelineStage(
        stage_module, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    runner = pipelining.Schedule1F1B(stage, MICROBATCHES, loss_fn=lm_loss)
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)

    def step() -> None:
        if pp_rank == 0:
            runner.step(x)
        else:
            parts: list[Tensor] = []
            runner.step(target=y, losses=parts)  # equal micro-batches: the mean is the batch's
            losses.append(float(torch.stack(parts).mean()))
        opt.step()
        opt.zero_grad()

    return step


def conveyor_step(
    x: Tensor, y: Tensor, ctx: Any, losses: list[float]
) -> tuple[Step, conveyor.Pipeline]:
    pipe = conveyor.Pipeline(
        build_llama(), loss_fn=lm_loss, microbatches=MICROBATCHES, schedule="1f1b",
        context=ctx, tp_plan="auto", sample=(x, y),
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        losses.append(float(pipe.train_step(x, y)))
        opt.step()
        opt.zero_grad()

    return step, pipe


def worker(args: argparse.Namespace, timed: Callable[..., list[float]]) -> None:
    """Runs in each of the 4 processes; rank 0 prints the table."""
    torch.set_num_threads(1)
    ctx = conveyor.init(pp=PP, tp=TP)
    assert ctx.mesh is not None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    ours_loss: list[float] = []
    theirs_loss: list[float] = []
    runs: dict[str, Step] = {}
    runs["conveyor"], pipe = conveyor_step(x, y, ctx, ours_loss)
    runs["torch"] = torch_step(x, y, ctx.mesh, theirs_loss)
    for run in runs.values():  # the first step of each, from the same weights: equal losses
        run()
    firsts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(firsts, theirs_loss[:1])
    theirs_first = next(f[0] for f in firsts if f)
    times, _ = alternate(runs, None, args.rounds, timed, args.steps, args.warmup)
    if dist.get_rank() != 0:
        return
    ours, theirs = (statistics.median(times[k]) for k in ("conveyor", "torch"))
    print(
        f"\nLlama (transformers) {LAYERS} layers x width {WIDTH}, sequence {SEQUENCE}, batch "
        f"{BATCH} in {MICROBATCHES} micro-batches, pp {PP} x tp {TP} = {PROCS} processes x 1 "
        f"thread, gloo; median of {args.rounds} rounds x {args.steps} steps\n"
        f"conveyor's automatic split:\n{pipe.describe()}\n"
        f"first step's loss: conveyor {ours_loss[0]:.6f}, torch {theirs_first:.6f}\n"
    )
    print("| conveyor schedule | conveyor ms | torch schedule | torch ms | conveyor/torch |")
    print("|---|---:|---|---:|---:|")
    print(f"| 1f1b, tp_plan='auto' | {ours * 1e3:.0f} | Schedule1F1B + parallelize_module "
          f"| {theirs * 1e3:.0f} | {ours / theirs:.2f} |")  # fmt: skip
