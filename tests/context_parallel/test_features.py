"""Context parallelism with the rest of conveyor, in one process (every cp rank's share side
by side): recompute (attention dropout's masks replayed), autocast, a meta build with
``weights=``, checkpoints loaded at another cp, and ``conveyor.Trainer``; each against
the unsplit model on the whole batch (every gradient, two steps), or against the same
pipeline without the feature where the unsplit model cannot be the reference (dropout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import conveyor
from conveyor.context_parallel import op
from conveyor.context_parallel.rotation import Stacked
from conveyor.losses import TokenCrossEntropy
from tests.context_parallel.test_pipeline import ROWS, VOCAB, Block, check, padded_batches
from tests.support.helpers import assert_close, rel_err, reset_context

LOSS = TokenCrossEntropy(shift=True)
BALANCE = [3, 3]


def net(dropout: float = 0.0) -> nn.Sequential:
    """Embedding, three blocks, norm and head (six layers), the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 32), *(Block(32, 4, dropout) for _ in range(3)),
                         nn.LayerNorm(32), nn.Linear(32, VOCAB))  # fmt: skip


Steps = list[tuple[float, dict[str, torch.Tensor]]]


def unsplit(model: nn.Module, batches: list[dict[str, torch.Tensor]], **autocast: Any) -> Steps:
    """The unsplit model's loss and gradients per step (SGD between steps), the whole
    batch's token mean; ``autocast``: ``torch.autocast``'s keywords."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for b in batches:
        with torch.autocast("cpu", enabled=bool(autocast), **autocast):
            total, count = LOSS(model(b["input_ids"]), b["labels"])
        loss = total / count
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def steps(pipe: conveyor.Pipeline, batches: list[dict[str, torch.Tensor]]) -> Steps:
    """The pipeline's loss and gradients per step (SGD between steps)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = []
    for b in batches:
        loss = pipe.train_step(b["input_ids"], b["labels"])
        out.append((float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def pipeline(cp: int, model: nn.Module | None = None, **options: Any) -> conveyor.Pipeline:
    """``model`` (default :func:`net`) on pp 2 x ``cp`` in this process."""
    reset_context()
    conveyor.init(pp=2, cp=cp)
    options.setdefault("balance", BALANCE)
    return conveyor.Pipeline(model if model is not None else net(), loss_fn=LOSS,
                             microbatches=2, **options)  # fmt: skip


# ------------------------------------------------------------------------ recompute
@pytest.mark.parametrize(
    ("schedule", "recompute", "balance"),
    [("zb-h1", True, BALANCE), ("1f1b", [1], BALANCE),
     ("interleaved-1f1b", {1, 2}, [2, 1, 1, 2])],
)  # fmt: skip
def test_recompute_is_exact(schedule: str, recompute: Any, balance: list[int]) -> None:
    """The re-run forward of a recomputed stage runs the attention over the whole
    sequence again: every stage, some stages, a split backward."""
    batches = padded_batches()
    want = unsplit(net(), batches)
    pipe = pipeline(2, schedule=schedule, recompute=recompute, balance=balance)
    check(steps(pipe, batches), want, f"{schedule} recompute {recompute}")


def test_recompute_replays_attention_dropout() -> None:
    """Attention dropout draws its seed from torch's generator, which the re-run forward
    replays: the recomputed pipeline's losses and gradients are those of the same pipeline
    keeping its activations, under the same seed (and not the dropout-free model's)."""
    batches = padded_batches()
    runs = {}
    for recompute in (False, True):
        pipe = pipeline(2, net(dropout=0.3), schedule="zb-h1", recompute=recompute)
        torch.manual_seed(7)
        runs[recompute] = steps(pipe, batches)
    check(runs[True], runs[False], "recompute with attention dropout")
    clean = unsplit(net(), batches)
    assert all(abs(d[0] - c[0]) > 1e-3 for d, c in zip(runs[True], clean, strict=True))


# ------------------------------------------------------------------------ autocast
def test_autocast_in_bf16() -> None:
    """``autocast=torch.bfloat16``: the loss and gradients of the unsplit model under the
    same autocast, within one bf16 rounding, and not the float32 model's (0.5% apart)."""
    batches = padded_batches()
    want = unsplit(net(), batches, dtype=torch.bfloat16)
    fp32 = unsplit(net(), batches)
    got = steps(pipeline(2, autocast=torch.bfloat16), batches)
    for step, ((loss, grads), (ref_loss, ref_grads), (_, fp32_grads)) in enumerate(
        zip(got, want, fp32, strict=True)
    ):
        assert loss == pytest.approx(ref_loss, rel=1e-4), f"step {step}"
        assert {g.dtype for g in grads.values()} == {torch.float32}
        # measured: at most 0.44 of one bf16 rounding of the gradients' norm
        assert_close(grads, ref_grads, f"bf16 step {step}", reduction=1, dtype=torch.bfloat16)
        flat = [torch.cat([d[n].flatten() for n in sorted(d)]) for d in (grads, fp32_grads)]
        assert rel_err(*flat) > 1e-3, "the gradients are the float32 model's"


def test_attention_computes_in_float32_and_returns_the_input_dtype() -> None:
    """bf16 queries, keys and values: the output is bf16 and within one bf16 rounding of
    the float32 attention of the same values (a bf16 computation rounds at every step)."""
    torch.manual_seed(0)
    cp, shape = 2, (2, 4, 64, 16)
    q, k, v = (torch.randn(shape).to(torch.bfloat16).requires_grad_() for _ in range(3))
    key = op.register(Stacked(cp))
    from conveyor.context_parallel import layout

    def share(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([layout.cut(t, 2, cp, r) for r in range(cp)])

    out = op.context_attention(share(q), share(k), share(v), key, causal=True)
    assert out.dtype == torch.bfloat16
    whole = layout.join(list(out.chunk(cp)), 2)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs()
    assert bool(((whole.float() - want).abs() <= ulp + 1e-6).all())
    whole.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ meta and weights=
def test_a_meta_build_initializes_as_the_unsplit_model_and_loads_safetensors(
    tmp_path: Path,
) -> None:
    """Under ``conveyor.empty_weights()``: ``weights=None`` gives ``materialize``'s
    weights; ``weights=`` a safetensors file, its tensors; either trains exactly."""
    batches = padded_batches()
    with conveyor.empty_weights():
        model = net()
    with conveyor.empty_weights():
        meta_reference = net()
    conveyor.materialize(meta_reference, init_seed=3)
    pipe = pipeline(2, model, init_seed=3)
    for name, p in pipe.named_parameters():
        assert torch.equal(p, meta_reference.state_dict()[name]), name
    check(steps(pipe, batches), unsplit(meta_reference, batches), "weights=None")

    torch.manual_seed(5)
    stored = {n: t + 0.02 * torch.randn_like(t) for n, t in net().state_dict().items()}
    save_file(stored, str(tmp_path / "model.safetensors"))
    with conveyor.empty_weights():
        model = net()
    pipe = pipeline(2, model, weights=tmp_path)
    for name, p in pipe.named_parameters():
        assert torch.equal(p, stored[name]), name
    loaded = net()
    loaded.load_state_dict(stored)
    check(steps(pipe, batches), unsplit(loaded, batches), "weights=safetensors")


# ------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2), (2, 4)])
def test_a_checkpoint_loads_at_another_cp(saved: int, loaded: int, tmp_path: Path) -> None:
    """A step at cp ``saved``, ``conveyor.save`` with AdamW's state, ``conveyor.load`` at
    cp ``loaded``, two more steps: the losses and gradients of three uninterrupted steps
    of the unsplit model."""
    batches = padded_batches(3)

    def adamw_steps(owner: Any, step: Any, batches: list[Any], opt: Any = None) -> Any:
        opt = opt or torch.optim.AdamW(owner.parameters(), lr=1e-2)
        out = []
        for b in batches:
            out.append((step(b), {n: p.grad.clone() for n, p in owner.named_parameters()}))
            opt.step()
            opt.zero_grad()
        return out, opt

    model = net()

    def whole(b: dict[str, torch.Tensor]) -> float:
        total, count = LOSS(model(b["input_ids"]), b["labels"])
        (total / count).backward()
        return float(total.detach() / count)

    want, _ = adamw_steps(model, whole, batches)
    first = pipeline(saved)
    got, opt = adamw_steps(first, lambda b: float(first.train_step(b["input_ids"], b["labels"])),
                           batches[:1])  # fmt: skip
    conveyor.save(first, tmp_path, opt, step=1)
    again = pipeline(loaded)
    opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    assert conveyor.load(again, tmp_path, opt) == 1
    more, _ = adamw_steps(again, lambda b: float(again.train_step(b["input_ids"], b["labels"])),
                          batches[1:], opt)  # fmt: skip
    check(got + more, want, f"cp {saved} -> cp {loaded}")


# ------------------------------------------------------------------------ Trainer
def test_the_trainer_trains_as_the_unsplit_model() -> None:
    """``conveyor.Trainer`` over a loader of (ids, labels): every step's loss, and the
    weights after three, the unsplit model's."""
    batches = padded_batches(3)
    data = TensorDataset(torch.cat([b["input_ids"] for b in batches]),
                         torch.cat([b["labels"] for b in batches]))  # fmt: skip
    model = net()
    want = [loss for loss, _ in unsplit(model, batches)]
    pipe = pipeline(2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=ROWS)
    history = conveyor.Trainer(pipe, opt).fit(loader, epochs=1)
    assert history.losses == [pytest.approx(w, rel=1e-5) for w in want]
    assert_close(dict(pipe.named_parameters()), dict(model.named_parameters()), "weights")


# ------------------------------------------------------------------------ compile
def test_compiled_stages_keep_the_attention_operator_whole() -> None:
    """Under ``compile``, dynamo's graphs call ``conveyor::cp_attention`` as one node (its
    transfers and blocks stay inside it); the stages train exactly."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    batches = padded_batches()
    pipe = pipeline(2, schedule="zb-h1", compile={"backend": backend})
    check(steps(pipe, batches), unsplit(net(), batches), "compiled (recorded)")
    calls = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in graphs]
    # the blocks share their code: a graph per batch size, each with one attention
    blocks = [c for c in calls if "conveyor.cp_attention.default" in c]
    assert blocks and all(c.count("conveyor.cp_attention.default") == 1 for c in blocks)
    inside = ("roll", "logsumexp", "logaddexp", "batch_isend_irecv", "all_gather")
    assert not [t for c in calls for t in c if any(word in t for word in inside)]


@pytest.mark.slow  # inductor compiles each block's forward and backward: about a minute
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_compiled_stages_are_exact(schedule: str) -> None:
    """``compile=True`` (inductor), whole and split backward: the unsplit model's loss and
    gradients; with attention dropout, recompute replays the compiled stages' masks."""
    batches = padded_batches()
    pipe = pipeline(2, schedule=schedule, compile=True)
    check(steps(pipe, batches), unsplit(net(), batches), f"compiled {schedule}")
    runs = {}
    for recompute in (False, True):
        # each pipeline compiles afresh: past dynamo's recompile limit a frame runs eagerly
        # (another dropout stream), which would compare eager with compiled
        torch.compiler.reset()
        pipe = pipeline(2, net(dropout=0.3), schedule=schedule, compile=True, recompute=recompute)
        torch.manual_seed(7)
        runs[recompute] = steps(pipe, batches)
    check(runs[True], runs[False], f"compiled {schedule} with dropout, recomputed")
