"""Context-parallel attention against the whole sequence's attention in one piece
(``torch.nn.functional.scaled_dot_product_attention``): outputs and the gradients of
queries, keys and values, with every cp rank's share computed in this process."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from conveyor.context_parallel import attention, layout
from conveyor.context_parallel.attention import Plan, RingAttention, Sequence
from conveyor.context_parallel.blocks import Dropout
from conveyor.context_parallel.masks import Rule
from conveyor.context_parallel.rotation import Stacked
from tests.support.helpers import assert_close


def reference_mask(rule: Rule, length: int, doc: Tensor | None, valid: Tensor | None) -> Tensor:
    """``[B or 1, 1, S, S]``: True where a query may attend a key, over the whole sequence."""
    i = torch.arange(length)
    mask = torch.ones(1, 1, length, length, dtype=torch.bool)
    if rule.causal:
        mask = mask & (i[None, :] <= i[:, None])
    if rule.window is not None:
        mask = mask & (i[:, None] - i[None, :] < rule.window)
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    return mask


def cut_stack(t: Tensor, cp: int) -> Tensor:
    return torch.stack([layout.cut(t, 2, cp, r) for r in range(cp)])


def join(t: Tensor) -> Tensor:
    return layout.join(list(t.unbind(0)), 2)


def compare(
    cp: int,
    rule: Rule,
    *,
    heads: int = 4,
    kv_heads: int = 4,
    length: int = 32,
    doc: Tensor | None = None,
    valid: Tensor | None = None,
    tile: int | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> None:
    torch.manual_seed(0)
    b, d = 2, 8
    q = torch.randn(b, heads, length, d, requires_grad=True)
    k = torch.randn(b, kv_heads, length, d, requires_grad=True)
    v = torch.randn(b, kv_heads, length, d, requires_grad=True)
    w = torch.randn(b, heads, length, d)
    mask = reference_mask(rule, length, doc, valid)
    groups = heads // kv_heads
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    )
    (ref * w).sum().backward()
    want = {"out": ref.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    q.grad = k.grad = v.grad = None
    if tile is not None and monkeypatch is not None:
        monkeypatch.setattr(attention, "TILE", tile)
    plan = Plan(Stacked(cp), Sequence(length, cp, doc, valid), rule, d**-0.5, Dropout(0.0, 0))
    out = RingAttention.apply(cut_stack(q, cp), cut_stack(k, cp), cut_stack(v, cp), plan)
    whole = join(out)
    (whole * w).sum().backward()
    got = {"out": whole.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    for name in want:
        assert_close({name: got[name]}, {name: want[name]}, f"cp {cp} {rule} {name}")


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_causal_and_full_attention(cp: int, causal: bool) -> None:
    compare(cp, Rule(causal))


def test_grouped_query_attention() -> None:
    compare(2, Rule(True), heads=4, kv_heads=2)
    compare(4, Rule(True), heads=6, kv_heads=1)


def test_packed_documents_never_attend_across_a_boundary() -> None:
    # documents crossing chunk and rank boundaries (chunks of 4 tokens at cp 4)
    doc = torch.tensor([[0] * 3 + [1] * 10 + [2] * 19, [0] * 17 + [1] * 15])
    compare(4, Rule(True), doc=doc)
    compare(2, Rule(False), doc=doc)


def test_padding_is_never_attended() -> None:
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[0, :5] = False  # left padding
    valid[1, 27:] = False  # right padding
    compare(2, Rule(True), valid=valid)
    compare(4, Rule(False), valid=valid)


def test_sliding_window() -> None:
    compare(4, Rule(True, window=5))
    compare(2, Rule(True, window=9), doc=torch.tensor([[0] * 20 + [1] * 12] * 2))


def test_tiles_smaller_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    compare(2, Rule(True), length=64, tile=5, monkeypatch=monkeypatch)


def test_a_causal_rank_skips_what_it_cannot_see() -> None:
    # rank 0 holds chunks 0 and 3 of 4: its first chunk sees only itself, so of the two
    # blocks' four chunk pairs per tile, the future ones are skipped
    plan = Plan(Stacked(2), Sequence(16, 2), Rule(True), 1.0, Dropout(0.0, 0))
    queries = plan.sequence.tokens([0])
    own = attention._pieces(plan, queries, plan.sequence.tokens([0]), 8, 0, torch.device("cpu"))
    other = attention._pieces(plan, queries, plan.sequence.tokens([1]), 8, 1, torch.device("cpu"))
    assert len(own) == 3  # chunk 0 vs 0 (diagonal), 3 vs 0, 3 vs 3 (diagonal)
    assert len(other) == 2  # chunk 3 vs 1 and 3 vs 2; chunk 0 sees neither
    assert all(mask is None for _, (c0, _), mask, _ in other)


def test_dropout_redraws_its_masks_in_the_backward() -> None:
    # the gradient of a dropped-out attention matches its own finite differences
    torch.manual_seed(0)
    cp, length, d = 2, 4, 2
    plan = Plan(Stacked(cp), Sequence(length, cp), Rule(True), d**-0.5, Dropout(0.5, 123))
    q, k, v = (torch.randn(cp, 1, 2, length // cp, d, dtype=torch.float64) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    attention_of = lambda a, b, c: RingAttention.apply(a, b, c, plan)  # noqa: E731
    assert torch.autograd.gradcheck(attention_of, (q, k, v), fast_mode=True)


def _on_ranks(
    rank: int, cp: int, rule: Rule, doc: Tensor | None, gathered: bool
) -> dict[str, Tensor]:
    import torch.distributed as dist

    from conveyor.context_parallel.rotation import Gathered, Ring, Rotation

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    b, h, hkv, length, d = 2, 4, 2, 32, 8
    q = torch.randn(b, h, length, d, requires_grad=True)
    k = torch.randn(b, hkv, length, d, requires_grad=True)
    v = torch.randn(b, hkv, length, d, requires_grad=True)
    w = torch.randn(b, h, length, d)
    ring = Ring(rank, tuple(range(cp)), dist.group.WORLD, timeout=30.0)
    rotation: Rotation = Gathered(ring) if gathered else ring
    plan = Plan(rotation, Sequence(length, cp, doc), rule, d**-0.5, Dropout(0.0, 0))

    def share(t: Tensor) -> Tensor:
        return layout.cut(t, 2, cp, rank)[None]

    out = RingAttention.apply(share(q), share(k), share(v), plan)
    (out * share(w)).sum().backward()
    return {"out": out[0].detach(), "q": q.grad, "k": k.grad, "v": v.grad}


@pytest.mark.multiprocess
@pytest.mark.parametrize("gathered", [False, True], ids=["ring", "all-gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_across_processes(cp: int, gathered: bool) -> None:
    from tests.support import distributed

    doc = torch.tensor([[0] * 7 + [1] * 25, [0] * 20 + [1] * 12])
    rule = Rule(True)
    results = distributed.run(_on_ranks, cp, cp, rule, doc, gathered, fork=True)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    k = torch.randn(2, 2, 32, 8, requires_grad=True)
    v = torch.randn(2, 2, 32, 8, requires_grad=True)
    w = torch.randn(2, 4, 32, 8)
    mask = reference_mask(rule, 32, doc, None)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    (ref * w).sum().backward()
    got_out = layout.join([r["out"] for r in results], 2)
    assert_close({"out": got_out}, {"out": ref.detach()}, "out")
    for name, want in (("q", q.grad), ("k", k.grad), ("v", v.grad)):
        total = sum(r[name] for r in results)
        assert_close({name: total}, {name: want}, name)
