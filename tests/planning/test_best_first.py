"""``best_layouts``' branch and bound on made-up layouts whose every bound and prediction
the test chooses (ties, bounds equal to the prediction, bounds that loosen on the way):
the first ``top`` of the exhaustive ranking, in its order; no layout predicted whose
tightest bound already ranked below the ``top`` best predicted before it; no memory walked
for a layout whose memory bound is over the limit."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.planning.search import best_layouts

LIMIT = 10.0


@dataclass(frozen=True)
class Made:
    """A layout with its prediction and its bounds (``global_batch * seq / gpus`` = 1)."""

    index: int
    step: float
    memory: float
    ladder: tuple[float, ...]  # the work bound, then each rung's step bound
    memory_bound: float
    runs: bool  # False: its schedule cannot run it (no memory, no prediction)
    global_batch: int = 1
    seq: int = 1
    gpus: int = 1


@dataclass(frozen=True)
class MadeEstimate:
    layout: Made
    tokens_per_s_per_gpu: float
    memory_gb: float

    def fits(self, limit: float) -> bool:
        return self.memory_gb <= limit


@dataclass
class MadePredictor:
    top: int
    predicted: list[Made] = field(default_factory=list)
    walked: list[Made] = field(default_factory=list)

    def work(self, layout: Made) -> float:
        return layout.ladder[0]

    def rung(self, layout: Made, rung: int) -> tuple[float, float] | None:
        if rung + 1 < len(layout.ladder):
            return layout.ladder[rung + 1], 0.0
        return (0.0, layout.memory_bound) if rung + 1 == len(layout.ladder) else None

    def memory_gb(self, layout: Made) -> float | None:
        self.walked.append(layout)
        return layout.memory if layout.runs else None

    def predict(self, layout: Made) -> MadeEstimate | None:
        fitting = layout.memory <= LIMIT
        if fitting:  # it could still be among the best `top` that fit
            best = sorted((e.step, e.index) for e in self.predicted if e.memory <= LIMIT and e.runs)
            tightest = (max(layout.ladder), layout.index)
            assert len(best) < self.top or tightest <= best[self.top - 1], layout
        self.predicted.append(layout)
        if not layout.runs:
            return None
        return MadeEstimate(layout, 1 / layout.step, layout.memory)


def _made(index: int, draw: st.DrawFn) -> Made:
    step = draw(st.sampled_from([1.0, 1.5, 2.0, 2.0, 3.0]))  # ties, many
    memory = draw(st.sampled_from([4.0, 8.0, LIMIT, 12.0, 30.0]))
    shares = draw(st.lists(st.sampled_from([0.25, 0.5, 0.9, 1.0]), min_size=1, max_size=4))
    return Made(
        index=index,
        step=step,
        memory=memory,
        ladder=tuple(step * s for s in shares),
        memory_bound=memory * draw(st.sampled_from([0.1, 0.5, 1.0])),
        runs=draw(st.booleans()) or draw(st.booleans()),
    )


@st.composite
def _layouts(draw: st.DrawFn) -> list[Made]:
    return [_made(i, draw) for i in range(draw(st.integers(1, 40)))]


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.integers(1, 12))
def test_best_first_gives_the_exhaustive_rankings_first_k(layouts: list[Made], top: int) -> None:
    predictor = MadePredictor(top)
    got = best_layouts(predictor, layouts, LIMIT, top)  # type: ignore[arg-type]
    ranked = sorted(
        (lay for lay in layouts if lay.runs), key=lambda m: (m.memory > LIMIT, m.step, m.index)
    )
    assert [r.layout for r in got] == ranked[:top]
    assert [r.fits for r in got] == [m.memory <= LIMIT for m in ranked[:top]]
    assert all(m.memory_bound <= LIMIT for m in predictor.walked)
    assert len(set(predictor.predicted)) == len(predictor.predicted)  # each once
