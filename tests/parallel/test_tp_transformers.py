"""Tensor parallelism on transformers decoders (captured with torch.export): pp=2 x tp=2
(4 processes, gloo), exact against the unsplit model.

Tiny Llama, Qwen2, Qwen3, Mistral and Mixtral from configs (tests/support/tp_models.py), with
``tp_plan="auto"`` (the model's own ``base_model_tp_plan``: attention and dense MLPs;
Mixtral's experts stay whole, replicated over tp), ``loss_fn=None`` with labels padded by
-100 on rows of different lengths, 3 micro-batches cut unevenly, two steps of other
sequence lengths: the loss and every gradient, each rank's local shard against the
matching slice of the unsplit model's gradient. The same for each transformers style
``tp_plan="auto"`` maps (conveyor/runtime/tp_styles.py) on a two-layer model whose plan
uses it, in a world of their own: OLMo 2 (``colwise_gather_output``,
``rowwise_split_input``), Phi-3 (the same on fused projections), Nemotron-H
(``embedding_rowwise``) and, for the styles no transformers model's plan uses
(``colwise_rep``, ``rowwise_rep``, ``embedding_colwise``), a Llama whose config's plan is
rewritten to use them. One world (forked, sharing the captures made here)
also runs, on the Llama:

- ``pipe.clip_grad_norm_`` on the Qwen3 (its q/k norms' gradients are partial sums);
- a hand-written plan with the embedding sharded by rows and the output layer column
  parallel with replicated logits;
- ``conveyor.save`` under tp 2, loaded into the unsplit model and into a one-process
  pipeline (tp 1);
- the meta device: ``weights=`` a ``save_pretrained`` directory, and ``weights=None``
  equal to ``conveyor.materialize``;
- ``compile={"dynamic": False}`` (aot_eager) and ``recompute=True``;
- zb-h1 (its backward split into B and W) and interleaved-1f1b (two stages per rank);
- the NCCL-rules replay of what every rank posts on 1f1b and zb-h1 (the tp collectives
  in the same order on every member of the tp group).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import conveyor
from tests.support import tp_models as M
from tests.support.helpers import reset_context
from tests.support.nccl_model import Record, check
from tests.support.nccl_record import recording
from tests.support.trainer_forked import run_forked

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

KINDS = ("llama", "qwen2", "qwen3", "mistral", "mixtral")
STYLED = ("olmo2", "phi3", "nemotron_h", "llama rep")  # the other styles of tp_plan="auto"


def rep_plan(model: Any) -> Any:
    """``model`` (a Llama) with its config's plan rewritten to the styles no transformers
    model's plan uses: the embedding by features, q/k/v gathered, o_proj split again."""
    attn = "layers.*.self_attn"
    model.config.base_model_tp_plan = {
        "embed_tokens": "embedding_colwise",
        **{f"{attn}.{p}_proj": "colwise_rep" for p in "qkv"},
        f"{attn}.o_proj": "rowwise_rep",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    return model


def hand_plan() -> dict[str, Any]:
    """The Llama's plan written out, with the embedding (rows) and the output layer
    (columns, logits replicated) too; the first matching pattern wins."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "model.layers.*.mlp.*_proj": ColwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def _pipe(model: Any, **options: Any) -> conveyor.Pipeline:
    options.setdefault("tp_plan", "auto")
    return conveyor.Pipeline(model, loss_fn=None, microbatches=M.MICRO,
                             sample=(M.batches()[0], None), **options)  # fmt: skip


def _recorded(model: Any, schedule: str, **options: Any) -> list[dict[str, Any]]:
    """What this rank posts in one step (NCCL-rules replay)."""
    pipe = _pipe(model, schedule=schedule, **options)
    with recording(functional=True) as trace:
        pipe.train_step(M.batches()[0], None)
    return [r.to_dict() for r in trace]


def world(rank: int, tmp: str, hf: str, models: dict[str, Any]) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, tp=2, timeout=120)
    out: dict[str, Any] = {"ranks": {"tp": ctx.tp_rank, "pp": ctx.pp_rank}}
    for kind in KINDS:
        out[kind] = M.train(_pipe(models[kind]))
    pipe = _pipe(models["hand"], tp_plan=hand_plan())
    out["hand placements"] = {n: str(p.placements[-1]) for n, p in pipe.named_parameters()
                              if hasattr(p, "placements")}  # fmt: skip
    out["hand plan"] = M.train(pipe)
    pipe = _pipe(models["save"])
    out["eval"] = float(pipe.eval_step(M.batches()[0], None))
    predicted = pipe.predict(M.batches()[0])  # the structure it was captured with
    out["logits"] = None if predicted is None else predicted.logits
    out["saved"] = M.train(pipe, steps=1)
    conveyor.save(pipe, tmp)
    out["meta weights"] = M.train(_pipe(models["meta hf"], weights=hf))
    out["meta init"] = M.train(_pipe(models["meta init"], weights=None))
    torch._dynamo.reset()
    compiled = _pipe(models["compile"], compile={"dynamic": False, "backend": "aot_eager"})
    out["compile"] = M.train(compiled)
    out["compiled"] = compiled.compile_stats is not None
    out["recompute"] = M.train(_pipe(models["recompute"], recompute=True))
    out["zb-h1"] = M.train(_pipe(models["zb-h1"], schedule="zb-h1"))
    out["interleaved"] = M.train(_pipe(models["interleaved"], schedule="interleaved-1f1b",
                                       chunks=2))  # fmt: skip
    for name, p in models["clip"].named_parameters():  # only the q / k norms train
        p.requires_grad_(_qk_norm(name))
    clipped = _pipe(models["clip"])
    clipped.train_step(M.batches()[0], None)
    out["norm"] = float(clipped.clip_grad_norm_(0.5))
    for schedule in ("1f1b", "zb-h1"):
        out[f"nccl {schedule}"] = _recorded(models[f"nccl {schedule}"], schedule)
    # with the vocabulary layers' rows over the pipeline ranks of each tp slice
    out["vocab"] = M.train(_pipe(models["vocab"], vocab_parallel=True))
    out["nccl vocab"] = _recorded(models["nccl vocab"], "1f1b", vocab_parallel=True)
    return out


def _qk_norm(name: str) -> bool:
    return name.endswith(("q_norm.weight", "k_norm.weight"))


def _meta_llama() -> torch.nn.Module:
    with conveyor.empty_weights():
        return M.tiny("llama")


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp")
    hf = tmp / "hf"
    M.tiny("llama").save_pretrained(hf)
    materialized = conveyor.materialize(_meta_llama(), init_seed=0)
    want = {kind: M.reference(kind) for kind in KINDS}
    want["init"] = M.reference("llama", materialized)
    models = {kind: M.captured(M.tiny(kind), "auto", 2) for kind in KINDS}
    models["hand"] = M.captured(M.tiny("llama"), hand_plan(), 2)
    for name in ("save", "compile", "recompute", "zb-h1", "interleaved", "nccl 1f1b",
                 "nccl zb-h1"):  # fmt: skip
        models[name] = M.captured(M.tiny("llama"), "auto", 2)
    models["clip"] = M.captured(M.tiny("qwen3"), "auto", 2)
    models["meta hf"] = M.captured(_meta_llama(), "auto", 2)
    models["meta init"] = M.captured(_meta_llama(), "auto", 2)
    models["vocab"] = M.tiny("llama")  # captured by the ranks, without its vocabulary layers
    models["nccl vocab"] = M.tiny("llama")
    got = run_forked(world, 4, str(tmp / "ckpt"), str(hf), models, timeout=900)
    return dict(want=want, got=got, ckpt=tmp / "ckpt")


def _exact(results: dict[str, Any], key: str, want: str = "llama", steps: int = 2) -> None:
    held: set[str] = set()
    for rank, got in enumerate(results["got"]):
        held |= M.check(got[key][:steps], results["want"][want][:steps], got["ranks"],
                        {"tp": 2, "pp": 2}, f"{key} rank {rank}")  # fmt: skip
    assert held == set(results["want"][want][0][1]), f"{key}: parameters no rank holds"


@pytest.mark.parametrize("kind", KINDS)
def test_auto_plan_is_exact(results: dict[str, Any], kind: str) -> None:
    """Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms on the local heads: their
    gradients partial sums over tp), Mistral (eager attention), Mixtral (experts whole)."""
    _exact(results, kind, kind)
    # the attention projections are really sharded: half the rows on each tp rank
    got = results["got"][0][kind][0][1]
    local, placement = got["model.layers.0.self_attn.k_proj.weight"]
    assert placement == "tp:S(0)" and local.shape[0] == 64 // 4 * 2 // 2


def styled_model(kind: str) -> Any:
    """A two-layer model of ``kind`` in :data:`STYLED`."""
    if kind == "llama rep":
        return rep_plan(M.tiny("llama", layers=2))
    return M.tiny(kind, layers=2)


def styled_world(rank: int, models: dict[str, Any]) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, tp=2, timeout=120)
    out: dict[str, Any] = {"ranks": {"tp": ctx.tp_rank, "pp": ctx.pp_rank}}
    for kind in STYLED:
        pipe = _pipe(models[kind])
        out[kind] = M.train(pipe)
        out[f"{kind} cuts"] = {n: (str(p.placements[-1]), tuple(p.to_local().shape))
                               for n, p in pipe.named_parameters()
                               if hasattr(p, "placements")}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def styled() -> dict[str, Any]:
    """The models of :data:`STYLED` on pp 2 x tp 2 (a world of their own: each world's
    captures and steps stay within the test time-out)."""
    want = {kind: M.reference(kind, styled_model(kind)) for kind in STYLED}
    models = {kind: M.captured(styled_model(kind), "auto", 2) for kind in STYLED}
    return dict(want=want, got=run_forked(styled_world, 4, models, timeout=600))


# per model: parameters and the placement (local shape) tp gives each weight
STYLED_CUTS = {
    "olmo2": {"model.layers.0.self_attn.q_proj.weight": ("S(0)", (32, 64)),
              "model.layers.0.self_attn.o_proj.weight": ("S(1)", (64, 32)),
              "model.layers.0.mlp.down_proj.weight": ("S(1)", (64, 64))},
    "phi3": {"model.layers.0.self_attn.qkv_proj.weight": ("S(0)", (64, 64)),
             "model.layers.0.self_attn.o_proj.weight": ("S(1)", (64, 32)),
             "model.layers.0.mlp.gate_up_proj.weight": ("S(0)", (128, 64))},
    "nemotron_h": {"model.embeddings.weight": ("S(0)", (64, 64))},
    "llama rep": {"model.embed_tokens.weight": ("S(1)", (128, 32)),
                  "model.layers.0.self_attn.k_proj.weight": ("S(0)", (16, 64)),
                  "model.layers.0.self_attn.o_proj.weight": ("S(1)", (64, 32))},
}  # fmt: skip


@pytest.mark.parametrize("kind", STYLED)
def test_each_auto_style_is_exact_on_a_model_that_uses_it(
    styled: dict[str, Any], kind: str
) -> None:
    """colwise_gather_output / rowwise_split_input (OLMo 2's q/k/v, whose norms span all
    heads; Phi-3's fused q/k/v and gate/up, sliced after), embedding_rowwise (Nemotron-H's
    embedding: vocabulary rows), colwise_rep / rowwise_rep / embedding_colwise (a Llama
    with a rewritten plan: the embedding's features): exact, and sharded as named."""
    _exact(styled, kind, kind)
    cuts = {n: cut for got in styled["got"] for n, cut in got[f"{kind} cuts"].items()}
    for name, want in STYLED_CUTS[kind].items():
        assert cuts[name] == want, name


def test_clipping_counts_partial_sums_once(results: dict[str, Any]) -> None:
    """Qwen3's q/k norm gradients are partial sums over tp: the norm sums them first
    (only they train here, so they are the whole norm)."""
    grads = results["want"]["qwen3"][0][1]
    want = sum(float(g.double().pow(2).sum()) for n, g in grads.items() if _qk_norm(n))
    for got in results["got"]:
        assert got["norm"] == pytest.approx(want**0.5, rel=1e-5)


def test_hand_written_plan_with_embedding_and_output_layer(results: dict[str, Any]) -> None:
    _exact(results, "hand plan")
    placements = {n: p for r in results["got"] for n, p in r["hand placements"].items()}
    assert placements["model.embed_tokens.weight"] == "S(0)"
    assert placements["lm_head.weight"] == "S(0)"


def test_checkpoint_saved_under_tp_loads_unsplit_and_at_tp1(results: dict[str, Any]) -> None:
    _exact(results, "saved", steps=1)
    # the unsplit model after one SGD step: the checkpoint holds whole tensors
    model = M.tiny("llama")
    opt = torch.optim.SGD(model.parameters(), lr=M.LR)
    model(**M.batches()[0]).loss.backward()
    opt.step()
    want = model.state_dict()
    fresh = M.tiny("llama")
    conveyor.load(fresh, results["ckpt"])
    for name, value in fresh.state_dict().items():
        assert torch.allclose(value, want[name], rtol=1e-5, atol=1e-7), name
    # a one-process pp 2 pipeline (tp 1) loads it and computes the next step's loss
    reset_context()
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(M.tiny("llama"), loss_fn=None, microbatches=M.MICRO,
                             sample=(M.batches()[1], None))  # fmt: skip
    conveyor.load(pipe, results["ckpt"])
    loss = float(pipe.train_step(M.batches()[1], None))
    assert loss == pytest.approx(results["want"]["llama"][1][0], rel=1e-5)
    reset_context()


def test_eval_step_and_predict(results: dict[str, Any]) -> None:
    model = M.tiny("llama")
    with torch.no_grad():
        logits = model(**M.batches()[0]).logits
    for got in results["got"]:
        assert got["eval"] == pytest.approx(results["want"]["llama"][0][0], rel=1e-5)
    last = [r["logits"] for r in results["got"] if r["logits"] is not None]
    assert len(last) == 2  # the last stage's two tensor-parallel ranks
    for got in last:
        assert float((got - logits).norm() / logits.norm()) < 1e-5


def test_meta_device(results: dict[str, Any]) -> None:
    """weights= a save_pretrained directory, and weights=None equal to materialize."""
    _exact(results, "meta weights")
    _exact(results, "meta init", want="init")


def test_compile_and_recompute(results: dict[str, Any]) -> None:
    assert all(r["compiled"] for r in results["got"])
    _exact(results, "compile")
    _exact(results, "recompute")


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
def test_other_schedules(results: dict[str, Any], schedule: str) -> None:
    """A split backward (zb-h1) and two stages per rank (interleaved-1f1b)."""
    _exact(results, schedule)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_nccl_rules_replay(results: dict[str, Any], schedule: str) -> None:
    runs = [r[f"nccl {schedule}"] for r in results["got"]]
    traces = {rank: [Record.from_dict(x) for x in run] for rank, run in enumerate(runs)}
    collectives = [[x for x in t if x.kind == "collective"] for t in traces.values()]
    assert all(collectives), "no tp collective recorded"
    check(traces)


def test_vocab_parallel_with_tp(results: dict[str, Any]) -> None:
    """vocab_parallel=True on the Llama under tp_plan='auto': the embedding's and the output
    layer's rows over the 2 pipeline ranks of each tensor-parallel slice, the attention
    and MLPs over tp, exact; what every rank posts replays under NCCL's rules."""
    _exact(results, "vocab")
    got = results["got"][0]["vocab"][0][1]
    local, placement = got["lm_head.weight"]
    assert placement == "pp:S(0)" and local.shape[0] == M.tiny("llama").config.vocab_size // 2
    runs = [r["nccl vocab"] for r in results["got"]]
    check({rank: [Record.from_dict(x) for x in run] for rank, run in enumerate(runs)})
