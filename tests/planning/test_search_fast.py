"""The layout search's branch and bound (``rank_layouts(top=k)``): its bounds never
exceed a prediction, and it returns exactly the first k of the exhaustive ranking."""

from __future__ import annotations

import dataclasses
import gc
import time

import pytest

pytest.importorskip("transformers")
from transformers import LlamaConfig

from conveyor.planning.bounds import placement
from conveyor.planning.cluster import layout_schedule
from conveyor.planning.counting import count_model
from conveyor.planning.devices import hardware
from conveyor.planning.predictor import Predictor
from conveyor.planning.search import layouts, rank_layouts

ARGS = dict(hardware="a100-80g", gpus=8, seq=1024, global_batch=16)


def llama(layers: int = 6, h: int = 256) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
    )


def _same(fast: list, full: list) -> None:  # type: ignore[type-arg]
    assert [r.layout for r in fast] == [r.layout for r in full]
    assert [r.fits for r in fast] == [r.fits for r in full]
    assert [
        (r.estimate.step_s, r.estimate.memory_gb, r.estimate.tokens_per_s_per_gpu) for r in fast
    ] == [(r.estimate.step_s, r.estimate.memory_gb, r.estimate.tokens_per_s_per_gpu) for r in full]


def test_the_bounds_never_exceed_a_prediction_and_place_stages_as_the_schedule() -> None:
    config = llama()
    counted = count_model(config, 1024, "bf16")
    hw = hardware("a100-80g")
    predictor = Predictor(counted, hw)
    checked = tight = tailed = recomputing = 0
    for layout in layouts(counted, hw, 8, 1024, 16, "bf16"):
        bounds, est = predictor.bounds(layout), predictor.predict(layout)
        if est is None:
            continue
        assert bounds is not None
        step, memory = bounds
        assert step <= est.step_s and memory <= est.memory_gb, layout
        with_tail = predictor.tail_bound(layout)
        assert step <= with_tail <= est.step_s, layout
        tailed += with_tail > step  # the optimizer step at least
        tight += step > 0.5 * est.step_s and memory > 0.3 * est.memory_gb
        schedule = layout_schedule(layout, [], 0.0)
        assert placement(layout) == list(schedule.placement), layout
        # The ladder: each rung's step bound at most the prediction, and tighter than the
        # work bound; its memory rung the memory bound.
        work = predictor.work(layout)
        assert work is not None and work <= est.step_s and work <= step * (1 + 1e-12)
        rungs = []
        while (rung := predictor.rung(layout, len(rungs))) is not None:
            rungs.append(rung)
        assert rungs[0] == (step, 0.0) and rungs[1] == (with_tail, 0.0)
        assert rungs[-1] == (0.0, memory)
        assert all(s <= est.step_s for s, _ in rungs[:-1]), layout
        if layout.recompute is True:
            assert len(rungs) == 5
            twin = dataclasses.replace(layout, recompute=False)
            assert rungs[2][0] in (0.0, predictor.steps.get(twin))
            again = rungs[3][0]
            assert again >= with_tail
            recomputing += again > with_tail * 1.05  # the forwards again: much later
        else:
            assert len(rungs) == 3
        checked += 1
    assert checked > 200 and tight > 0.9 * checked  # bounds that say something
    assert tailed > 0.5 * checked
    assert recomputing > 0.3 * checked / 2


@pytest.mark.parametrize("limit", [None, 0.03, 1e-6])
def test_the_top_k_are_the_exhaustive_rankings_first_k(
    limit: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = llama()
    full = rank_layouts(config, **ARGS, memory_limit_gb=limit)
    predicted = []
    plain = Predictor.predict
    monkeypatch.setattr(
        Predictor, "predict", lambda self, lay: predicted.append(lay) or plain(self, lay)
    )
    _same(rank_layouts(config, **ARGS, memory_limit_gb=limit, top=5), full[:5])
    assert len(predicted) < len(full) / 4  # the bounds spared most of them
    if limit == 0.03:  # some fit, most do not: the search goes on among those over it
        assert 0 < sum(r.fits for r in full) < 10
    for top in (1, 10, 40):
        _same(rank_layouts(config, **ARGS, memory_limit_gb=limit, top=top), full[:top])
    assert len(rank_layouts(config, **ARGS, memory_limit_gb=limit, top=10**6)) == len(full)


@pytest.mark.parametrize("share", [0.02, 0.1])
def test_the_top_k_of_deeper_pipelines_are_the_exhaustive_rankings_first_k(
    share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 layers on 16 GPUs under a limit only the leanest few (`share`) fit: pipelines that
    # recompute lead, so every rung of the ladder (the twin's step, the forwards again)
    # is climbed.
    config, args = llama(8, 512), dict(hardware="h100-sxm", gpus=16, seq=2048, global_batch=32)
    memory = sorted(r.estimate.memory_gb for r in rank_layouts(config, **args))
    limit = memory[int(share * len(memory))]
    full = rank_layouts(config, **args, memory_limit_gb=limit)
    assert full[0].layout.recompute is True and full[0].layout.pp > 1
    predicted = []
    plain = Predictor.predict
    monkeypatch.setattr(
        Predictor, "predict", lambda self, lay: predicted.append(lay) or plain(self, lay)
    )
    for top in (1, 8, 30):
        _same(rank_layouts(config, **args, memory_limit_gb=limit, top=top), full[:top])
    assert len(predicted) < len(full) / 10


@pytest.mark.parametrize("was", [True, False])
@pytest.mark.parametrize("top", [None, 2])
def test_the_collector_is_paused_for_the_search_only(
    was: bool, top: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def predict(self: Predictor, layout: object) -> None:
        seen.append(gc.isenabled())
        raise RuntimeError("stop")

    monkeypatch.setattr(Predictor, "predict", predict)
    (gc.enable if was else gc.disable)()
    try:
        with pytest.raises(RuntimeError, match="stop"):
            rank_layouts(llama(), **ARGS, top=top)
        assert seen == [False] and gc.isenabled() is was
    finally:
        gc.enable()


def test_top_must_be_a_positive_integer() -> None:
    from conveyor.errors import ConfigError

    with pytest.raises(ConfigError, match="top must be an integer >= 1, got 0"):
        rank_layouts(llama(), **ARGS, top=0)


@pytest.mark.slow
def test_llama_405b_on_16384_gpus_ranks_in_under_10_s() -> None:
    config = LlamaConfig(
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    ranked = rank_layouts(
        config, hardware="h100-sxm", gpus=16384, seq=8192, global_batch=2048, top=15
    )
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"405B on 16,384 GPUs: top 15 in {cpu:.1f} s CPU, {wall:.1f} s wall")
    assert len(ranked) == 15 and ranked[0].fits
    assert dataclasses.astuple(ranked[0].layout)[:4] == (64, 4, 16, 4)  # pp, tp, dp, cp
    assert cpu < 10
