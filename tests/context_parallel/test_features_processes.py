"""Context parallelism with the rest of conveyor on real processes (pp 2 x cp 2: the ring's
transfers between processes, every checkpoint writer): a transformers Llama with packed
documents, recomputed (attention dropout's masks replayed), under autocast, built on the
meta device, compiled, and saved by ``conveyor.save`` / ``conveyor.save_pretrained`` (one
cp rank writing each tensor) into checkpoints that load at cp 1 and cp 4 in one process
and train on exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.context_parallel.test_features import LOSS, net, steps, unsplit
from tests.context_parallel.test_pipeline import VOCAB, check, packed_batches, padded_batches
from tests.support import distributed
from tests.support.helpers import assert_close, reset_context

Runs = list[tuple[float, dict[str, torch.Tensor]]]


def llama(dropout: float = 0.0) -> nn.Module:
    """A small Llama (grouped-query attention), the same weights every call."""
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                           use_cache=False, attention_dropout=dropout)  # fmt: skip
    return T.LlamaForCausalLM(config)


def lm_steps(owner: Any, step: Any, batches: list[Any], opt: Any) -> Runs:
    """``step(batch)`` per batch with ``opt`` stepping between: losses and gradients."""
    out = []
    for b in batches:
        loss = float(step(b))
        out.append((loss, {n: p.grad.clone() for n, p in owner.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def whole(model: nn.Module, batches: list[Any], adam: bool = False, **autocast: Any) -> Runs:
    """The unsplit model on the whole batches (``autocast``: ``torch.autocast``'s keywords)."""

    def step(b: Any) -> torch.Tensor:
        with torch.autocast("cpu", enabled=bool(autocast), **autocast):
            loss = model(**b).loss
        loss.backward()
        return loss.detach()

    params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=0.1)
    return lm_steps(model, step, batches, opt)


def piped(pipe: conveyor.Pipeline, batches: list[Any], adam: bool = False) -> Runs:
    params = pipe.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=0.1)
    return lm_steps(pipe, pipe.train_step, batches, opt)


def _features(rank: int, tmp: str) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, cp=2)
    batches = packed_batches()
    sample = (batches[0], None)
    out: dict[str, Any] = {"cp rank": ctx.cp_rank}

    def pipeline(model: nn.Module, **options: Any) -> conveyor.Pipeline:
        return conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=sample, **options)

    out["recompute"] = piped(pipeline(llama(), schedule="zb-h1", recompute=True), batches)
    for recompute in (False, True):
        pipe = pipeline(llama(dropout=0.3), schedule="zb-h1", recompute=recompute)
        torch.manual_seed(7)
        out[f"dropout {recompute}"] = piped(pipe, batches)
    out["autocast"] = piped(pipeline(llama(), autocast=torch.bfloat16), batches)
    with conveyor.empty_weights():
        model = llama()
    out["meta"] = piped(pipeline(model, init_seed=3), batches)
    # compiled stages of a layer list (dynamo and AOT autograd around the operator; the
    # one-process tests run inductor, whose worker pools forked workers cannot use)
    pipe = conveyor.Pipeline(net(), loss_fn=LOSS, microbatches=2, balance=[3, 3],
                             schedule="zb-h1", compile={"backend": "aot_eager"})  # fmt: skip
    out["compiled"] = steps(pipe, padded_batches())
    # one AdamW step, then both checkpoints
    pipe = pipeline(llama())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    out["first"] = lm_steps(pipe, pipe.train_step, batches[:1], opt)
    conveyor.save(pipe, f"{tmp}/ckpt", opt, step=1)
    conveyor.save_pretrained(pipe, f"{tmp}/hf", max_shard_size="1GB")
    out["trained"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return out


def _stored_by(path: Path) -> dict[str, set[int]]:
    """The ranks whose files hold each tensor of the conveyor checkpoint at ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    current = path / (path / "latest").read_text().strip()
    meta = FileSystemReader(str(current)).read_metadata()
    out: dict[str, set[int]] = {}
    for index, info in meta.storage_data.items():
        rank = int(info.relative_path.split("_")[2])  # "__<rank>_0.distcp"
        out.setdefault(index.fqn, set()).add(rank)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_cp2_features_on_four_processes(tmp_path: Path) -> None:
    results = distributed.run(_features, 4, str(tmp_path), fork=True, timeout=900)
    batches = packed_batches()
    want = whole(llama(), batches)
    for r, out in enumerate(results):
        assert out["cp rank"] == r % 2
        check(out["recompute"], want, f"rank {r} recompute")
        check(out["dropout True"], out["dropout False"], f"rank {r} recompute with dropout")
        assert abs(out["dropout True"][0][0] - want[0][0]) > 1e-3  # dropout ran
        check(out["compiled"], unsplit(net(), padded_batches()), f"rank {r} compiled")
    bf16 = whole(llama(), batches, dtype=torch.bfloat16)
    for r, out in enumerate(results):
        for step, ((loss, grads), (ref, ref_grads)) in enumerate(
            zip(out["autocast"], bf16, strict=True)
        ):
            assert loss == pytest.approx(ref, rel=1e-4), f"rank {r} autocast step {step}"
            sub = {n: ref_grads[n] for n in grads}
            assert_close(grads, sub, f"rank {r} autocast", reduction=1, dtype=torch.bfloat16)
    with conveyor.empty_weights():
        meta = llama()
    meta_want = whole(conveyor.materialize(meta, init_seed=3), batches)
    for r, out in enumerate(results):
        check(out["meta"], meta_want, f"rank {r} meta")
    check_checkpoints(results, tmp_path)


def check_checkpoints(results: list[dict[str, Any]], tmp_path: Path) -> None:
    """One cp rank (cp rank 0) wrote each tensor of both checkpoints; they hold the trained
    weights; the conveyor checkpoint resumes at cp 1 and cp 4 exactly."""
    trained: dict[str, torch.Tensor] = {}
    for out in results:
        trained.update(out["trained"])
    stored = _stored_by(tmp_path / "ckpt")
    assert any(name.startswith("optim/") for name in stored)
    for name, ranks in stored.items():
        assert len(ranks) == 1 and ranks <= {0, 2}, f"{name} written by ranks {ranks}"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # one file per pp rank's writer
    import transformers as T

    published = T.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert_close({n: published[n] for n in trained}, trained, "save_pretrained")
    batches = packed_batches(3)
    want = whole(llama(), batches, adam=True)
    for r, out in enumerate(results):
        check(out["first"], want[:1], f"rank {r} first step")
    for cp in (1, 4):
        reset_context()
        conveyor.init(pp=2, cp=cp)
        pipe = conveyor.Pipeline(llama(), loss_fn=None, microbatches=2,
                                 sample=(batches[0], None))  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        assert conveyor.load(pipe, tmp_path / "ckpt", opt) == 1
        check(lm_steps(pipe, pipe.train_step, batches[1:], opt), want[1:], f"resumed at cp {cp}")
