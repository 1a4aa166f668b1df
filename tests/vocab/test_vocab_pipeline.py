"""Vocabulary parallelism (``Pipeline(vocab_parallel=...)``) against the unsplit model.

The unsplit model's loss is the WHOLE batch's token cross-entropy (padded rows, -100
targets, a sum over counted tokens over their count); each pipeline is compared on loss
and every gradient (its rows of the vocabulary layers against the same rows of the
unsplit model's), on 1F1B, ZB-H1 and V-Half, in one process and on 2 and 4 processes,
tied and untied, for a torch.fx-traced GPT, a layer list and a transformers Llama with
``loss_fn=None``. The 4-process world also runs pp2 x dp2 with replicas of different
token counts and gradient accumulation over two steps, then a checkpoint that the unsplit
model loads. What each rank posts is replayed under NCCL's rules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import ConfigError
from conveyor.losses import TokenCrossEntropy
from conveyor.schedules.vocab import vocab_collectives
from conveyor.vocab.shards import chunk_rows
from tests.support import distributed
from tests.support.helpers import assert_close, rounding_bound
from tests.support.helpers import grads_of as named_grads
from tests.vocab.models import VOCAB, TinyGPT, layer_list, padded_batch, tiny_llama

SCHEDULES = ("1f1b", "zb-h1", "v-half")
LOSS = TokenCrossEntropy(shift=True)
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def make(kind: str, tied: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return TinyGPT(tied)
    if kind == "layers":
        return layer_list()
    return tiny_llama(tied)


def reference(kind: str, tied: bool, batches: list[Any]) -> tuple[list[float], dict[str, Any]]:
    """The unsplit model's loss of each whole batch and the gradients summed over them."""
    model = make(kind, tied)
    losses = []
    for ids, targets in batches:
        if kind == "llama":
            loss = model(input_ids=ids, labels=targets).loss
        else:
            total, count = LOSS(model(ids), targets)
            loss = total / count
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def grads_of(pipe: conveyor.Pipeline, pp: int, pp_rank: int) -> dict[str, Any]:
    """This rank's gradients: (tensor, lo, hi) with the rows [lo, hi) of a split weight."""
    out = {}
    for name, p in pipe.named_parameters():
        g = p.grad
        if hasattr(g, "to_local"):
            lo, hi = chunk_rows(p.shape[0], pp, pp_rank)
            out[name] = (g.to_local().clone(), lo, hi)
        else:
            out[name] = (g.clone(), None, None)
    return out


def compare(results: list[tuple[list[float], dict[str, Any]]], want: Any, what: str) -> None:
    """Every rank's losses equal the reference's and its gradients its rows', and every
    parameter of the model has its gradient on some rank."""
    losses, grads = want
    bound = rounding_bound(grads.values())
    seen = set()
    for rank, (got_losses, got) in enumerate(results):
        for a, b in zip(got_losses, losses, strict=True):
            assert abs(a - b) <= TOL * abs(b), f"{what}: rank {rank} loss {a} != {b}"
        for name, (g, lo, hi) in got.items():
            w = grads[name] if lo is None else grads[name][lo:hi]
            assert g.shape == w.shape, f"{what}: {name} shape {g.shape} != {w.shape}"
            err = float((g - w).norm())
            assert err <= bound, f"{what}: rank {rank} {name} differs by {err:.2e} > {bound:.2e}"
            seen.add(name)
    assert seen == set(grads), f"{what}: no gradient for {sorted(set(grads) - seen)}"


def train(pipe: conveyor.Pipeline, kind: str, batches: list[Any]) -> list[float]:
    losses = []
    for ids, targets in batches:
        if kind == "llama":
            losses.append(float(pipe.train_step({"input_ids": ids, "labels": targets})))
        else:
            losses.append(float(pipe.train_step(ids, targets)))
    return losses


# Every schedule tied and untied on the fx-traced GPT; the Llama (its own loss, its
# embedding as inputs_embeds) on a split-backward and a V schedule, untied and tied.
CASES = [("gpt", s, tied) for s in SCHEDULES for tied in (False, True)] + [
    ("llama", "zb-h1", False), ("llama", "v-half", True)
]


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_process_world_is_exact(schedule: str, tied: bool) -> None:
    """pp=4 in one process (every stage here, the vocabulary whole): two accumulated
    steps of padded batches, micro-batches of uneven rows."""
    batches = [padded_batch(6, 9, seed=0), padded_batch(5, 7, seed=1)]
    want = reference("gpt", tied, batches)
    ctx = conveyor.init(pp=4)
    pipe = conveyor.Pipeline(
        make("gpt", tied), loss_fn=LOSS, microbatches=4, schedule=schedule, context=ctx,
        vocab_parallel=True,
    )  # fmt: skip
    compare([(train(pipe, "gpt", batches), grads_of(pipe, 1, 0))], want, schedule)


@pytest.mark.slow
def test_one_process_layer_list_llama_eval_and_predict() -> None:
    """A layer list (embedding first, output layer last) and a transformers Llama with its
    own loss; eval_step gives the loss, predict the unsplit model's logits."""
    batches = [padded_batch()]
    ctx = conveyor.init(pp=2)
    for kind in ("layers", "llama"):
        want = reference(kind, False, batches)
        pipe = conveyor.Pipeline(
            make(kind, False), loss_fn=None if kind == "llama" else LOSS, microbatches=3,
            context=ctx, vocab_parallel=True,
        )  # fmt: skip
        compare([(train(pipe, kind, batches), grads_of(pipe, 1, 0))], want, kind)
    ids, targets = batches[0]
    pipe = conveyor.Pipeline(make("gpt", True), loss_fn=LOSS, microbatches=3, context=ctx,
                             vocab_parallel=True)  # fmt: skip
    model = make("gpt", True)
    total, count = LOSS(model(ids), targets)
    assert abs(float(pipe.eval_step(ids, targets)) - float(total / count)) < 1e-6
    assert all(p.grad is None for p in pipe.parameters())
    logits = pipe.predict(ids)
    assert logits.shape == (*ids.shape, VOCAB)
    torch.testing.assert_close(logits, model(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_process_eval_and_predict_run_the_forward_passes(tied: bool) -> None:
    """A forward-only step runs the passes the vocabulary ends name for it (E and S; not
    T and G): eval_step gives the unsplit model's loss and predict its logits, and
    nothing gets a gradient."""
    ids, targets = padded_batch()
    with torch.no_grad():
        logits = make("gpt", tied)(ids)
        total, count = LOSS(logits, targets)
    pipe = conveyor.Pipeline(make("gpt", tied), loss_fn=LOSS, microbatches=3, schedule="zb-h1",
                             context=conveyor.init(pp=2), vocab_parallel=True)  # fmt: skip
    assert abs(float(pipe.eval_step(ids, targets)) - float(total / count)) < TOL
    torch.testing.assert_close(pipe.predict(ids), logits, rtol=TOL, atol=1e-6)
    assert all(p.grad is None for p in pipe.parameters())


def test_label_smoothing_recompute_and_the_names() -> None:
    """Label smoothing (one more sum), recompute of every stage, the vocabulary layers
    under their names in the model, and meta weights initialized like the unsplit model."""
    ids, targets = padded_batch()
    smooth = TokenCrossEntropy(shift=True, label_smoothing=0.1)
    model = make("gpt", False)
    total, count = smooth(model(ids), targets)
    (total / count).backward()
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(make("gpt", False), loss_fn=smooth, microbatches=4, context=ctx,
                             schedule="zb-h1", recompute=True, vocab_parallel=True)  # fmt: skip
    loss = pipe.train_step(ids, targets)
    assert abs(float(loss) - float(total / count)) < 1e-6
    want = named_grads(model.named_parameters())
    assert_close(named_grads(pipe.named_parameters()), want, "smoothing")
    with conveyor.empty_weights():
        meta = TinyGPT(tied=True)
    pipe = conveyor.Pipeline(meta, loss_fn=LOSS, microbatches=2, context=ctx, init_seed=4,
                             vocab_parallel=("wte", "head"))  # fmt: skip
    with conveyor.empty_weights():
        whole = TinyGPT(tied=True)
    conveyor.materialize(whole, init_seed=4)
    state = pipe.state_dict()
    assert set(state) >= {"wte.weight", "blocks.0.0.weight"}
    for name, value in state.items():
        assert torch.equal(value, whole.state_dict()[name]), name


def test_autocast_matches_the_unsplit_model_under_autocast() -> None:
    ids, targets = padded_batch()
    model = make("gpt", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, count = LOSS(model(ids), targets)
    (total / count).backward()
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(make("gpt", False), loss_fn=LOSS, microbatches=3, context=ctx,
                             autocast=torch.bfloat16, vocab_parallel=True)  # fmt: skip
    loss = pipe.train_step(ids, targets)
    assert abs(float(loss) - float(total / count)) < 2e-2 * float(total / count)
    # what rounds to bf16: the output of each of the 4 blocks and the head, both directions
    assert_close(named_grads(pipe.named_parameters()), named_grads(model.named_parameters()),
                 "autocast", reduction=10, dtype=torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"loss_fn": nn.functional.cross_entropy}, "TokenCrossEntropy"),
        ({"vocab_parallel": "nope"}, "not a module"),
        ({"vocab_parallel": ("blocks.0.0", "head")}, "not a plain nn.Embedding"),
        ({"vocab_parallel": 3}, "must be False, True"),
    ],
)
def test_what_cannot_be_split_is_refused_in_one_sentence(
    kwargs: dict[str, Any], words: str
) -> None:
    options = {"loss_fn": LOSS, "vocab_parallel": True} | kwargs
    with pytest.raises(ConfigError, match=words):
        conveyor.Pipeline(make("gpt", False), microbatches=2, context=conveyor.init(pp=2),
                          **options)  # fmt: skip


def test_an_output_layer_with_a_bias_is_refused() -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, VOCAB))
    with pytest.raises(ConfigError, match="bias"):
        conveyor.Pipeline(model, loss_fn=LOSS, microbatches=2, context=conveyor.init(pp=2),
                          vocab_parallel=("0", "2"))  # fmt: skip


# ------------------------------------------------------------------ processes
def _world(rank: int, pp: int, dp: int, cases: list[tuple[str, str, bool]]) -> dict[str, Any]:
    """Each case's two accumulated steps on this rank (a replica passes its own rows), and
    the collectives it posted on the vocabulary group, in order."""
    from conveyor.vocab import runner

    ctx = conveyor.init(pp=pp, dp=dp)
    posted: list[tuple[str, int]] = []
    original = runner.collective

    def spy(start: Any, timeout: float, doing: str, suspect: str) -> None:
        # doing: "rank R: the vocabulary WHAT of micro-batch M"
        what, m = doing.split(": the vocabulary ", 1)[1].rsplit(" of micro-batch ", 1)
        posted.append((what.split(" (")[0], int(m)))
        original(start, timeout, doing, suspect)

    runner.collective = spy
    out: dict[str, Any] = {}
    for kind, schedule, tied in cases:
        posted.clear()
        pipe = conveyor.Pipeline(
            make(kind, tied), loss_fn=None if kind == "llama" else LOSS, microbatches=4,
            schedule=schedule, context=ctx, vocab_parallel=True,
        )  # fmt: skip
        mine = [(ids[ctx.dp_rank :: dp], t[ctx.dp_rank :: dp]) for ids, t in _steps(dp)]
        losses = train(pipe, kind, mine)
        out[f"{kind} {schedule} {tied}"] = (
            losses, grads_of(pipe, pp, ctx.pp_rank), list(posted), vocab_collectives(pipe.schedule)
        )
    if dp > 1:
        conveyor.save(pipe, _ckpt_dir(), step=1)
    return out


def _steps(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two steps; with replicas, rows dealt round-robin, so their token counts differ."""
    return [padded_batch(8 * dp - 1, 9, seed=0), padded_batch(4 * dp + 1, 6, seed=1)]


def _ckpt_dir() -> str:
    import os

    return os.environ["VOCAB_TEST_CKPT"]


def _check_world(results: list[dict[str, Any]], cases: list[Any], dp: int, pp: int) -> None:
    for key in results[0]:
        kind, _, tied = key.split()
        want = reference(kind, tied == "True", _steps(dp))
        compare([(r[key][0], r[key][1]) for r in results], want, f"pp{pp} dp{dp} {key}")
        # Every rank posted the same collectives in the same order: the schedule's.
        posted = [r[key][2] for r in results]
        assert all(p == posted[0] for p in posted), key
        kinds = [(COLLECTIVE[what], m) for what, m in posted[0]]
        assert kinds == results[0][key][3] * 2, key  # two steps, each the schedule's order


COLLECTIVE = {
    "embedding sum": "reduce",
    "hidden-state broadcast": "broadcast",
    "statistics all-gather": "all_gather",
    "hidden-state gradient sum": "reduce",
    "embedding gradient broadcast": "broadcast",
}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_every_case_exact() -> None:
    results = distributed.run(_world, 2, 2, 1, [*CASES, ("layers", "1f1b", False)], fork=True,
                              timeout=400)  # fmt: skip
    _check_world(results, CASES, 1, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_processes_pp4_and_pp2_dp2(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [("gpt", s, tied) for s in SCHEDULES for tied in (False, True)]
    results = distributed.run(_world, 4, 4, 1, cases, fork=True, timeout=400)
    _check_world(results, cases, 1, 4)
    monkeypatch.setenv("VOCAB_TEST_CKPT", str(tmp_path / "ckpt"))
    dp_cases = [("gpt", "1f1b", True), ("llama", "v-half", False)]
    results = distributed.run(_world, 4, 2, 2, dp_cases, fork=True, timeout=400)
    _check_world(results, dp_cases, 2, 2)
    # The checkpoint (the last case's pipeline: Llama, after two steps, no optimizer step)
    # loads into the unsplit model: every tensor, the vocabulary layers whole.
    state = conveyor.load_model_state(tmp_path / "ckpt")
    model = make("llama", False)
    assert set(state) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name


# ------------------------------------------------------------------ NCCL's rules
def _record(rank: int, pp: int, names: list[str]) -> dict[str, Any]:
    """Each schedule with vocabulary passes: construction, two training steps of other
    shapes, an eval and a predict step, as this rank posted them."""
    from conveyor.schedules import default_chunks
    from tests.support.nccl_record import recording

    ctx = conveyor.init(pp=pp, timeout=60)
    out: dict[str, Any] = {}
    for name in names:
        with recording(functional=False) as trace:
            pipe = conveyor.Pipeline(
                make("gpt", True), loss_fn=LOSS, microbatches=2 * pp, schedule=name,
                chunks=default_chunks(name), context=ctx, vocab_parallel=True,
            )  # fmt: skip
            for rows, length in ((4 * pp, 9), (2 * pp + 1, 6), (2 * pp + 1, 6)):
                pipe.train_step(*padded_batch(rows, length))
            ids, targets = padded_batch(2 * pp, 5)
            pipe.eval_step(ids, targets)
            pipe.predict(ids)
        out[name] = [r.to_dict() for r in trace]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("pp", [2, 4])
def test_what_every_rank_posts_replays_under_nccl_rules(pp: int) -> None:
    """The passes' collectives (on the vocabulary group) and the transfers replay without
    deadlock under NCCL's rules (order matching, one stream per communicator, blocking or
    buffered sends): every schedule on 2 ranks, one of each family on 4."""
    from conveyor.schedules import SCHEDULE_NAMES
    from tests.support.nccl_model import Record, check

    names = [n for n in SCHEDULE_NAMES if n != "auto"] if pp == 2 else [
        "1f1b", "zb-h1", "interleaved-1f1b", "v-half", "dualpipev"
    ]  # fmt: skip
    results = distributed.run(_record, pp, pp, names, fork=True, timeout=600)
    for name in results[0]:
        traces = {r: [Record.from_dict(x) for x in run[name]] for r, run in enumerate(results)}
        posted = [x for t in traces.values() for x in t]
        p2p = {x.group for x in posted if x.kind in ("send", "recv")}
        passes = {x.group for x in posted if x.kind == "collective" and x.name in
                  ("reduce", "all_gather")}  # fmt: skip
        assert passes and not passes & p2p, name  # the passes' communicator is their own
        try:
            check(traces)
        except AssertionError as exc:
            raise AssertionError(f"pp{pp} {name}:\n{exc}") from None


def test_another_ignore_index_and_dropout_with_recompute() -> None:
    """``ignore_index=0`` (the padding id) with no shift counts what the unsplit loss
    counts; with dropout, recomputing every stage gives what keeping activations gives
    (the same masks: the passes draw no random numbers). Each row starts with the
    padding id, whose embedding row gets no gradient (``padding_idx``) though its output
    counts."""
    ids, targets = padded_batch()
    targets = targets.masked_fill(targets.eq(-100), 0)
    ids[:, 0] = 0
    loss = TokenCrossEntropy(ignore_index=0)
    model = make("gpt", False)
    total, count = loss(model(ids), targets)
    (total / count).backward()
    assert float(model.wte.weight.grad[0].abs().max()) == 0.0
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(make("gpt", False), loss_fn=loss, microbatches=4, context=ctx,
                             vocab_parallel=True)  # fmt: skip
    assert abs(float(pipe.train_step(ids, targets)) - float(total / count)) < 1e-6
    want = named_grads(model.named_parameters())
    assert_close(named_grads(pipe.named_parameters()), want, "pipe")
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        dropping = TinyGPT(tied=True, dropout=0.3)
        pipe = conveyor.Pipeline(dropping, loss_fn=LOSS, microbatches=3, context=ctx,
                                 recompute=recompute, vocab_parallel=True)  # fmt: skip
        torch.manual_seed(1)
        pipe.train_step(*padded_batch())
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_each_rank_rows_are_torch_chunks(ranks: int) -> None:
    """The rows of each rank are DTensor Shard(0)'s: torch.chunk's, the last ones fewer or
    none, covering the vocabulary once."""
    for rows in (1, 7, 36, 37, 100):
        chunks = torch.arange(rows).chunk(ranks)
        got = [chunk_rows(rows, ranks, r) for r in range(ranks)]
        want = [(int(c[0]), int(c[-1]) + 1) for c in chunks] + [(rows, rows)] * (
            ranks - len(chunks)
        )
        assert got == want, (rows, ranks)


@pytest.mark.slow
def test_compiled_stages_are_exact() -> None:
    """compile= (aot_eager: the graphs dynamo and AOTAutograd make, without inductor's
    rounding): the stages compiled, the passes eager around them."""
    ids, targets = padded_batch()
    model = make("gpt", True)
    total, count = LOSS(model(ids), targets)
    (total / count).backward()
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(make("gpt", True), loss_fn=LOSS, microbatches=3, context=ctx,
                             schedule="zb-h1", compile={"backend": "aot_eager"},
                             vocab_parallel=True)  # fmt: skip
    loss = pipe.train_step(ids, targets)
    assert abs(float(loss) - float(total / count)) < 1e-5 * float(total / count)
    want = named_grads(model.named_parameters())
    assert_close(named_grads(pipe.named_parameters()), want, "pipe")


def _loads(rank: int, where: str) -> dict[str, Any]:
    """Checkpoints into a vocabulary-parallel pipeline on 2 processes: conveyor.load of one
    the unsplit model saved, and weights= of a transformers save_pretrained directory;
    this rank's state after each (its rows of the vocabulary layers)."""
    ctx = conveyor.init(pp=2)
    pipe = conveyor.Pipeline(TinyGPT(tied=True), loss_fn=LOSS, microbatches=2, context=ctx,
                             vocab_parallel=True)  # fmt: skip
    conveyor.load(pipe, f"{where}/gpt")
    out = {"gpt": {n: local(v) for n, v in pipe.state_dict().items()}}
    with conveyor.empty_weights():
        llama = tiny_llama(tied=False)
    ids, labels = padded_batch(4, 6)
    pipe = conveyor.Pipeline(llama, loss_fn=None, microbatches=2, context=ctx,
                             weights=f"{where}/llama", vocab_parallel=True,
                             sample=({"input_ids": ids, "labels": labels}, None))  # fmt: skip
    out["llama"] = {n: local(v) for n, v in pipe.state_dict().items()}
    out["rows"] = chunk_rows(VOCAB, 2, ctx.pp_rank)
    return out


def local(value: Any) -> Any:
    return value.to_local().clone() if hasattr(value, "to_local") else value.clone()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoints_of_the_unsplit_model_load_into_the_rows(tmp_path: Any) -> None:
    torch.manual_seed(5)
    gpt = TinyGPT(tied=True)
    conveyor.save(gpt, tmp_path / "gpt")
    llama = make("llama", False)
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(torch.randn_like(p))  # not what initialization would give
    llama.save_pretrained(tmp_path / "llama")
    for got in distributed.run(_loads, 2, str(tmp_path), fork=True, timeout=300):
        lo, hi = got["rows"]
        for kind, model in (("gpt", gpt), ("llama", llama)):
            whole = model.state_dict()
            for name, value in got[kind].items():
                want = whole[name]
                if value.shape != want.shape:  # a vocabulary layer: this rank's rows
                    want = want[lo:hi]
                assert torch.equal(value, want), (kind, name)
