"""Context parallelism in the pipeline, against the unsplit model on the whole batch:
every gradient, two optimizer steps, padded rows of different lengths and packed
documents, uneven micro-batches; in one process (every cp rank's share side by side) and
on real processes (pp 2 x cp 2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.losses import TokenCrossEntropy
from tests.support import distributed
from tests.support.helpers import assert_close, reset_context

VOCAB, LENGTH, ROWS = 64, 16, 5


def llama(kind: str = "llama") -> nn.Module:
    import transformers as T

    common: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, **common))
    return T.LlamaForCausalLM(T.LlamaConfig(**common))


def padded_batches(steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Rows of different lengths, padded on the right (labels -100, attention mask 0)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
        lengths = torch.randint(4, LENGTH + 1, (ROWS,), generator=gen)
        mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def packed_batches(steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Rows packed from several documents as transformers' DataCollatorWithFlattening
    packs them (position ids restart per document, each document's first label -100)."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(2)
    collate = DataCollatorWithFlattening()
    out = []
    for _ in range(steps):
        rows = []
        for split in ([5, 3, 8], [11, 5], [2, 9, 5], [16], [7, 9]):
            docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()}
                    for n in split]  # fmt: skip
            rows.append(collate(docs))
        out.append({k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels",
                                                                  "position_ids")})  # fmt: skip
    return out


def unsplit(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[Any]:
    """Losses, gradients per step and parameters after SGD steps, on the whole batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def pipelined(pipe: conveyor.Pipeline, batches: list[dict[str, torch.Tensor]]) -> list[Any]:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = []
    for batch in batches:
        loss = pipe.train_step(batch)
        out.append((float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def check(got: list[Any], want: list[Any], what: str) -> None:
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{what} step {step}"
        assert_close(grads, {n: ref_grads[n] for n in grads}, f"{what} step {step}")


@pytest.mark.slow  # 5 s each (torch.export of the model)
@pytest.mark.parametrize(
    ("schedule", "cp", "data"),
    [("1f1b", 2, "padded"), ("zbv", 2, "packed"), ("zb-h1", 4, "packed")],
)
def test_a_transformers_model_in_one_process(schedule: str, cp: int, data: str) -> None:
    batches = padded_batches() if data == "padded" else packed_batches()
    want = unsplit(llama(), batches)
    reset_context()
    conveyor.init(pp=2, cp=cp)
    pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2, schedule=schedule)
    check(pipelined(pipe, batches), want, f"{schedule} cp {cp} {data}")


@pytest.mark.slow  # 5 s (torch.export of the model)
def test_predict_gives_whole_sequences() -> None:
    reset_context()
    batch = padded_batches(1)[0]
    model = llama()
    want = model(input_ids=batch["input_ids"]).logits
    conveyor.init(pp=2, cp=2)
    pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2)
    got = pipe.predict({"input_ids": batch["input_ids"]})
    assert_close({"logits": got.logits}, {"logits": want.detach()}, "predict")


class Block(nn.Module):
    """A pre-norm block whose attention is ``scaled_dot_product_attention`` (causal), with
    attention dropout in training mode."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln(x)).split(c, 2)
        )
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(x)


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 32), *(Block(32, 4) for _ in range(3)),
                         nn.LayerNorm(32), nn.Linear(32, VOCAB))  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4])
def test_a_layer_list_with_sdpa_and_a_next_token_loss(cp: int) -> None:
    loss_fn = TokenCrossEntropy(shift=True)
    batches = padded_batches()
    model = layers()
    want = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in batches:
        total, count = loss_fn(model(b["input_ids"]), b["labels"])
        (total / count).backward()
        want.append(
            (float(total / count), {n: p.grad.clone() for n, p in model.named_parameters()})
        )
        opt.step()
        opt.zero_grad()
    reset_context()
    conveyor.init(pp=2, cp=cp)
    pipe = conveyor.Pipeline(layers(), loss_fn=loss_fn, microbatches=2, balance=[3, 3])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    got = []
    for b in batches:
        loss = pipe.train_step(b["input_ids"], b["labels"])
        got.append((float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        opt.step()
        opt.zero_grad()
    check(got, want, f"layers cp {cp}")


def test_a_model_making_positions_from_its_length_is_refused() -> None:
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, 8), nn.Embedding(LENGTH, 8)
            self.head = nn.Linear(8, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
            return self.head(x)

    reset_context()
    conveyor.init(pp=2, cp=2)
    with pytest.raises(conveyor.ConfigError, match=r"makes positions with torch.arange"):
        conveyor.Pipeline(Positions(), loss_fn=TokenCrossEntropy(shift=True), microbatches=2)


def test_a_sequence_that_does_not_cut_evenly_is_refused() -> None:
    reset_context()
    conveyor.init(pp=2, cp=4)
    pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2)
    ids = torch.randint(0, VOCAB, (2, 12))
    with pytest.raises(conveyor.ConfigError, match=r"pad the sequences to a multiple of 8"):
        pipe.train_step({"input_ids": ids, "labels": ids})


def _on_ranks(rank: int, schedules: list[str], strategy: str, data: str) -> list[Any]:
    ctx = conveyor.init(pp=2, cp=2)
    assert (ctx.pp_rank, ctx.cp_rank) == (rank // 2, rank % 2)
    batches = padded_batches() if data == "padded" else packed_batches()
    out = []
    for schedule in schedules:
        pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2, schedule=schedule,
                                 cp_attention=strategy)  # fmt: skip
        out.append(pipelined(pipe, batches))
    return out


SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "data"), [("ring", "packed"), ("all-gather", "padded")])
def test_pp2_cp2_on_four_processes(strategy: str, data: str) -> None:
    batches = padded_batches() if data == "padded" else packed_batches()
    want = unsplit(llama(), batches)
    results = distributed.run(_on_ranks, 4, SCHEDULES, strategy, data, fork=True, timeout=400)
    for k, schedule in enumerate(SCHEDULES):
        for rank in range(4):
            check(results[rank][k], want, f"{schedule} {strategy} rank {rank}")
