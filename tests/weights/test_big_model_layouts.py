"""Models built on the meta device, on real processes: every layout gives each rank only
its own stages' (or shards') values, bit for bit those of ``conveyor.materialize`` of the
unsplit model, and one step's gradients are the unsplit model's on the whole batch (a
token mean over padded rows of different lengths, uneven replicas).

Layouts: pp=2 (1f1b), pp=4 interleaved (8 stages), pp=2 x dp=2 with FSDP (zb-h1),
pp=2 x tp=2, and a checkpoint saved by pp=2 loaded by a meta-built pp=2 x dp=2 FSDP
pipeline."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.losses import TokenCrossEntropy
from tests.support import distributed
from tests.support.helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402  (examples/gpt.py: the GPT example and its tensor-parallel plan)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SEED = 7
VOCAB, CONTEXT = 13, 8


def empty_gpt() -> gpt.GPT:
    with conveyor.empty_weights():
        return gpt.GPT(vocab=VOCAB, context=CONTEXT, width=16, depth=8, heads=4)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """9 rows of token ids, padded: the targets of rows ``i`` past ``2 + i % 6`` are -100."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (9, CONTEXT), generator=g)
    targets = torch.randint(0, VOCAB, (9, CONTEXT), generator=g)
    for i in range(9):
        targets[i, 2 + i % 6 :] = -100
    return ids, targets


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """The unsplit model's values, gradients and loss on the whole batch."""
    model = conveyor.materialize(empty_gpt(), init_seed=SEED)
    values = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    ids, targets = data()
    loss = torch.nn.functional.cross_entropy(
        model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return values, grads, loss.item()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _layout(rank: int, layout: dict[str, Any], weights: str | None) -> dict[str, Any]:
    ctx = conveyor.init(pp=layout["pp"], dp=layout.get("dp", 1), tp=layout.get("tp", 1))
    model = empty_gpt()
    pipe = conveyor.Pipeline(
        model,
        loss_fn=TokenCrossEntropy(),
        microbatches=4,
        schedule=layout["schedule"],
        fsdp=layout.get("fsdp", False),
        tp_plan=gpt.tp_plan() if layout.get("tp", 1) > 1 else None,
        weights=weights,
        init_seed=SEED,
    )
    # This rank's memory: its parameters' local elements (shards), against the elements of
    # its stages; the rest of the model stays meta.
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pipe.parameters())
    stages = sum(p.numel() for p in pipe.parameters())
    held = {id(p) for p in pipe.parameters()}
    real_elsewhere = [n for n, p in model.named_parameters() if not p.is_meta and id(p) not in held]
    values = {n: _whole(p).detach().clone() for n, p in pipe.named_parameters()}
    ids, targets = data()
    if ctx.dp_size > 1:  # uneven replicas: 5 rows and 4
        rows = [slice(0, 5), slice(5, 9)][ctx.dp_rank]
        ids, targets = ids[rows], targets[rows]
    loss = pipe.train_step(ids, targets)
    grads = {n: _whole(p.grad).clone() for n, p in pipe.named_parameters()}
    return {"values": values, "grads": grads, "loss": float(loss), "local": local,
            "stages": stages, "real_elsewhere": real_elsewhere}  # fmt: skip


def _check(results: list[dict[str, Any]], layout: dict[str, Any]) -> None:
    values, grads, loss = reference()
    whole = sum(v.numel() for n, v in values.items() if n != "head.weight")
    for r in results:
        assert r["real_elsewhere"] == [], r["real_elsewhere"]
        for n, v in r["values"].items():
            assert torch.equal(v, values[n]), f"{layout}: {n} differs from materialize's"
        assert abs(r["loss"] - loss) < 1e-5 * abs(loss)
        # a rank holds its stages (under FSDP their shards, under TP the sharded layers'
        # parts), not the whole model
        assert r["stages"] < 0.75 * whole
        if layout.get("fsdp"):
            assert r["local"] <= r["stages"] / 2 + 16 * len(r["values"]), r  # shards, padded
        elif layout.get("tp", 1) > 1:
            assert r["local"] < 0.75 * r["stages"]
        else:
            assert r["local"] == r["stages"]
    got = {n: g for r in results for n, g in r["grads"].items()}
    assert set(got) | {"head.weight"} == set(values), "every parameter is held somewhere"
    # Within what rounding reaches, measured against every gradient of the model: one zero
    # in exact arithmetic (attention's key bias) is rounding noise on both sides, of a size
    # that depends on the CPU's kernels. Sums over the batch's tokens and a width of 4 * 16.
    assert_close(got, {n: grads[n] for n in got}, f"{layout} gradients",
                 reduction=data()[0].numel() + 64)  # fmt: skip


LAYOUTS = [
    pytest.param({"pp": 2, "schedule": "1f1b"}, id="pp2"),
    pytest.param({"pp": 4, "schedule": "interleaved-1f1b"}, id="pp4-interleaved"),
    pytest.param({"pp": 2, "dp": 2, "fsdp": True, "schedule": "zb-h1"}, id="pp2xdp2-fsdp"),
    pytest.param({"pp": 2, "tp": 2, "schedule": "1f1b"}, id="pp2xtp2"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_initializes_only_its_share_exactly(layout: dict[str, Any]) -> None:
    world = layout["pp"] * layout.get("dp", 1) * layout.get("tp", 1)
    _check(distributed.run(_layout, world, layout, None, timeout=240, fork=True), layout)


def _save(rank: int, path: str) -> None:
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(
        conveyor.materialize(empty_gpt(), init_seed=SEED), loss_fn=TokenCrossEntropy(),
        microbatches=2,
    )  # fmt: skip
    conveyor.save(pipe, path)


def test_a_checkpoint_of_one_layout_loads_into_a_meta_pipeline_of_another(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    distributed.run(_save, 2, path, fork=True)
    layout = {"pp": 2, "dp": 2, "fsdp": True, "schedule": "1f1b"}
    _check(distributed.run(_layout, 4, layout, path, timeout=240, fork=True), layout)


def _reading(rank: int, layout: dict[str, Any], weights: str) -> dict[str, Any]:
    """:func:`_layout`, counting the bytes this rank reads from the safetensors files, and
    the bytes of the whole tensors it reads from."""
    from conveyor.weights.safetensors_file import File

    read = File.read
    counted = {"read": 0, "whole": 0}

    def counting(self: File, name: str, part: Any = None) -> torch.Tensor:
        value = read(self, name, part)
        counted["read"] += value.nbytes
        counted["whole"] += self.entries[name].nbytes
        return value

    File.read = counting  # type: ignore[method-assign]
    return {**_layout(rank, layout, weights), **counted}


@pytest.mark.parametrize("layout", LAYOUTS[2:])
def test_a_transformers_directory_is_read_only_as_far_as_each_rank_holds(
    tmp_path: Path, layout: dict[str, Any]
) -> None:
    """FSDP and tensor-parallel shards are read as boxes of the stored tensors
    (``safe_open``'s ``get_slice``): each rank reads its shards, not the whole tensors."""
    model = conveyor.materialize(empty_gpt(), init_seed=SEED)
    with pytest.warns(UserWarning, match="no config.json"):
        conveyor.save_pretrained(model, tmp_path / "hf", max_shard_size="20KB")
    world = layout["pp"] * layout.get("dp", 1) * layout.get("tp", 1)
    results = distributed.run(_reading, world, layout, str(tmp_path / "hf"), timeout=240,
                              fork=True)  # fmt: skip
    _check(results, layout)
    for r in results:
        # FSDP: half of every weight; TP: half of the sharded layers' (the rest whole,
        # small here); whole tensors would be all of it
        share = 0.51 if layout.get("fsdp") else 0.55
        assert 0 < r["read"] < share * r["whole"], r


def _vocab_rows(rank: int, weights: str) -> dict[str, Any]:
    from conveyor.weights.safetensors_file import File

    read = File.read
    boxes = []

    def logging(self: File, name: str, part: Any = None) -> torch.Tensor:
        boxes.append((name, part))
        return read(self, name, part)

    File.read = logging  # type: ignore[method-assign]
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(empty_gpt(), loss_fn=TokenCrossEntropy(), microbatches=2,
                             weights=weights, vocab_parallel=True)  # fmt: skip
    local = dict(pipe.named_parameters())["tok.weight"].to_local().detach().clone()
    return {"boxes": [b for b in boxes if b[0] == "tok.weight"], "local": local}


def test_vocabulary_rows_are_read_as_each_rank_holds_them(tmp_path: Path) -> None:
    model = conveyor.materialize(empty_gpt(), init_seed=SEED)
    with pytest.warns(UserWarning, match="no config.json"):
        conveyor.save_pretrained(model, tmp_path / "hf")
    results = distributed.run(_vocab_rows, 2, str(tmp_path / "hf"), fork=True)
    rows = [(0, 7), (7, 13)]  # torch.chunk's rule: ceil(13 / 2) rows, the rest
    for (lo, hi), r in zip(rows, results, strict=True):
        assert r["boxes"] == [("tok.weight", (slice(lo, hi), slice(0, 16)))]
        assert torch.equal(r["local"], model.tok.weight.detach()[lo:hi])


def _norms() -> torch.nn.Sequential:
    with conveyor.empty_weights():
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
            torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3),
        )  # fmt: skip


def _fsdp_state(rank: int) -> dict[str, torch.Tensor]:
    ctx = conveyor.init(pp=2, dp=2)
    model = _norms()
    with torch.no_grad():  # a real buffer's own value, which allocating the shards must keep
        model[1].running_var.fill_(3.0)
    pipe = conveyor.Pipeline(model, loss_fn=torch.nn.functional.mse_loss, microbatches=2,
                             fsdp=True, balance=[3, 3], init_seed=SEED, context=ctx)  # fmt: skip
    return {n: _whole(t).detach().clone() for n, t in pipe.state_dict().items()}


def test_fsdp_allocates_shards_and_keeps_the_real_buffers() -> None:
    want = conveyor.materialize(_norms(), init_seed=SEED).state_dict()
    want["1.running_var"] = torch.full((8,), 3.0)
    for got in distributed.run(_fsdp_state, 4, fork=True):
        assert got and all(torch.equal(v, want[n]) for n, v in got.items()), got.keys()


def _tied_llama(rank: int) -> dict[str, Any]:
    from tests.support.tp_models import batches
    from tests.support.tp_models import tiny as tiny_model

    conveyor.init(pp=2)
    config = tiny_model("llama").config
    config.tie_word_embeddings = True
    import transformers

    with conveyor.empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    batch = batches()[0]
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=(batch, None),
                             init_seed=SEED)  # fmt: skip
    loss = pipe.train_step(batch, None)
    return {"loss": float(loss), "tied": len(pipe.tied_copies()),
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}  # fmt: skip


def test_a_meta_built_transformers_model_keeps_its_tie_across_ranks() -> None:
    """The embedding (first stage) and the output layer (last stage) of a tied Llama built
    on meta are one weight: each rank's copy gets the gradient of both uses, as the
    unsplit model's weight does."""
    import transformers

    from tests.support.tp_models import batches
    from tests.support.tp_models import tiny as tiny_model

    config = tiny_model("llama").config
    config.tie_word_embeddings = True
    with conveyor.empty_weights():
        reference = transformers.AutoModelForCausalLM.from_config(config)
    conveyor.materialize(reference, init_seed=SEED)
    out = reference(**batches()[0])
    out.loss.backward()
    want = reference.model.embed_tokens.weight.grad
    results = distributed.run(_tied_llama, 2, fork=True)
    assert [r["tied"] for r in results] == [1, 1]
    for r, name in zip(results, ("model.embed_tokens.weight", "lm_head.weight"), strict=True):
        assert abs(r["loss"] - float(out.loss)) < 1e-5 * float(out.loss)
        assert_close({name: r["grads"][name]}, {name: want}, f"tied {name}", reduction=64)
