"""Planning a model built on the meta device (issue 34): ``balance=None`` and
``schedule="auto"`` never make the whole model real. The automatic split equals the real
model's; the planner times one real copy of one unit at a time; the pipeline it builds has
``conveyor.materialize``'s weights; with a deterministic clock the plan equals the real
model's plan exactly."""

from __future__ import annotations

import copy
import gc
import itertools
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.errors import ConfigError
from conveyor.partition import split_model
from conveyor.planning import profiler
from conveyor.planning.costs import UnitCost
from conveyor.planning.meta import RealUnits, release
from conveyor.planning.planner import Plan, plan
from tests.support import distributed, real_models

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402  (examples/gpt.py: a GPT that torch.fx traces)

SEED = 5


def uneven() -> nn.Sequential:
    """A layer list whose layers differ in size, so balances differ from an even cut."""
    widths = [8, 32, 64, 16, 48, 8, 8]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


class Tower(nn.Module):
    """Nested blocks, split by an execution sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def tower() -> nn.Module:
    return conveyor.sequence(Tower(), ["stem", "body.0", "body.1", "body.2", "head"])


def tiny_gpt(depth: int = 4) -> gpt.GPT:
    return gpt.GPT(vocab=13, context=8, width=16, depth=depth, heads=4)


def llama() -> nn.Module:
    return real_models.llama(4)[0]


def built_twice(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The model built real (seeded) and built under ``empty_weights``."""
    torch.manual_seed(0)
    real = build()
    with conveyor.empty_weights():
        meta = build()
    return real, meta


def _stage_names(stages: list[nn.Module]) -> list[list[str]]:
    return [sorted(n for n, _ in s.named_parameters()) for s in stages]


def _ids() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, real_models.VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


SPLITS = [
    pytest.param(uneven, None, 3, id="layer-list"),
    pytest.param(tower, None, 2, id="sequence"),
    pytest.param(tiny_gpt, None, 3, id="fx"),
    pytest.param(llama, _ids, 2, id="export", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("build", "sample", "stages"), SPLITS)
def test_balance_none_splits_a_meta_model_as_the_real_one(
    build: Callable[[], nn.Module], sample: Callable[[], Any] | None, stages: int
) -> None:
    real, meta = built_twice(build)
    x = sample() if sample is not None else None
    expected = _stage_names(split_model(real, stages, None, x))
    got = split_model(meta, stages, None, x)
    assert _stage_names(got) == expected
    assert all(p.is_meta for p in meta.parameters())  # nothing was made real


# ------------------------------------------------------------------ the planner on meta


def _real_parameter_bytes() -> dict[int, int]:
    """Every real ``nn.Parameter`` in the process, garbage not yet collected included:
    id -> bytes."""
    return {
        id(o): o.numel() * o.element_size()
        for o in gc.get_objects()
        if issubclass(type(o), nn.Parameter) and not o.is_meta  # type: ignore[attr-defined]
    }


class Watch:
    """Wraps the profiler's ``measure_unit``: at each unit timed, the bytes of real
    parameters alive anywhere in the process beyond those alive before planning, and the
    unit's own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.before = _real_parameter_bytes()
        self.seen: list[tuple[int, int]] = []  # (alive beyond before, the unit's bytes)
        measure = profiler.measure_unit

        def watched(index: int, unit: nn.Module, *args: Any) -> tuple[UnitCost, Any]:
            alive = _real_parameter_bytes()
            extra = sum(b for i, b in alive.items() if i not in self.before)
            own = sum(p.numel() * p.element_size() for p in unit.parameters())
            assert all(not p.is_meta for p in unit.parameters())
            self.seen.append((extra, own))
            return measure(index, unit, *args)

        monkeypatch.setattr(profiler, "measure_unit", watched)


def _gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 13, (4, 8), generator=g), torch.randint(0, 13, (4, 8), generator=g)


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.mark.slow
def test_planning_a_meta_model_holds_one_unit_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with conveyor.empty_weights():
        model = tiny_gpt(depth=1)
    watch = Watch(monkeypatch)
    x, y = _gpt_batch()
    plan(model, x, y, _token_loss, 2, microbatch_counts=[2], calibrate=False)
    assert len(watch.seen) > 10
    # Real parameters alive while a unit is timed are that unit's copy alone (a tied
    # embedding and head are copied once per unit that uses them).
    assert all(extra == own for extra, own in watch.seen), watch.seen
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("build", [uneven, tower], ids=["layer-list", "sequence"])
def test_auto_on_a_meta_model_has_the_weights_materialize_gives(
    build: Callable[[], nn.Module],
) -> None:
    with conveyor.empty_weights():
        model = build()
    reference = conveyor.materialize(copy.deepcopy(model), init_seed=SEED)
    conveyor.init(pp=2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = conveyor.Pipeline(
        model, loss_fn=F.mse_loss, microbatches=2, schedule="auto", sample=(x, y),
        init_seed=SEED,
    )  # fmt: skip
    assert pipe.plan is not None and pipe.plan.calibration is None  # one process
    expected = dict(reference.named_parameters())
    got = dict(pipe.named_parameters())
    assert got.keys() == expected.keys()
    for name, p in got.items():
        assert torch.equal(p, expected[name]), name
    loss = pipe.train_step(x, y)
    assert torch.allclose(loss, F.mse_loss(reference(x), y))


# ---------------------------------------------- the same plan as the real model's, exactly


@pytest.fixture
def deterministic_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Unit times from parameter and output bytes instead of a clock: what the profiler
    measures of sizes stays measured."""
    measure = profiler.measure_unit

    def sized(*args: Any) -> tuple[UnitCost, Any]:
        layer, out = measure(*args)
        t = (layer.parameters + layer.output + layer.activations + 4096) * 1e-9
        times = {
            "forward": t, "forward_plain": t, "backward_input": t, "backward_weight": t,
            "backward": 2 * t,
        }  # fmt: skip
        return UnitCost(**{**layer.__dict__, **times}), out

    monkeypatch.setattr(profiler, "measure_unit", sized)
    yield


def _same_plan(a: Plan, b: Plan) -> None:
    assert (a.schedule, a.chunks, a.microbatches, a.balance) == (
        b.schedule, b.chunks, b.microbatches, b.balance,
    )  # fmt: skip
    assert a.predicted_step == pytest.approx(b.predicted_step, rel=1e-9)
    assert a.peak_memory == b.peak_memory
    assert [(c.schedule, c.balance) for c in a.alternatives] == [
        (c.schedule, c.balance) for c in b.alternatives
    ]


PLANNED = [
    pytest.param(uneven, lambda: (torch.randn(8, 8), torch.randn(8, 8)), F.mse_loss, 2,
                 id="layer-list"),
    pytest.param(tower, lambda: (torch.randn(8, 8), torch.randn(8, 8)), F.mse_loss, 2,
                 id="sequence"),
    pytest.param(tiny_gpt, _gpt_batch, _token_loss, 2, id="fx"),
    pytest.param(llama, lambda: (_ids(), _ids()["labels"]), None, 2, id="export",
                 marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.usefixtures("deterministic_clock")
@pytest.mark.parametrize(("build", "batch", "loss_fn", "ranks"), PLANNED)
def test_the_plan_of_a_meta_model_is_the_real_models(
    build: Callable[[], nn.Module],
    batch: Callable[[], tuple[Any, Any]],
    loss_fn: Any,
    ranks: int,
) -> None:
    real, meta = built_twice(build)
    x, y = batch()
    loss_fn = loss_fn or _own_loss
    on_real = plan(real, x, y, loss_fn, ranks, microbatch_counts=[2, 4], calibrate=False)
    on_meta = plan(meta, x, y, loss_fn, ranks, microbatch_counts=[2, 4], calibrate=False)
    _same_plan(on_meta, on_real)
    assert on_meta.profile is not None and on_real.profile is not None
    sizes = [(u.parameters, u.activations, u.output) for u in on_real.profile.layers]
    assert [(u.parameters, u.activations, u.output) for u in on_meta.profile.layers] == sizes
    assert all(p.is_meta for p in meta.parameters())


def _own_loss(out: Any, _: Any) -> torch.Tensor:
    """A transformers model's own loss (it was given ``labels``)."""
    loss: torch.Tensor = out.loss
    return loss


# --------------------------------------- two processes: calibration on the rank's own stages


def _calibrated(rank: int) -> dict[str, Any]:
    from conveyor.planning import calibration

    conveyor.init()
    references: list[tuple[int, int]] = []  # (real bytes of the model built, of its stages)
    build = calibration.build

    def watched(module: nn.Module, *args: Any) -> Any:
        parts = build(module, *args)
        real = {id(p): p for p in module.parameters() if not p.is_meta}
        own = {id(p): p for s in parts.stages.values() for p in s.parameters()}
        references.append((_bytes(real.values()), _bytes(own.values())))
        return parts

    calibration.build = watched  # type: ignore[assignment]
    with conveyor.empty_weights():
        model = uneven()
    names = [n for n, _ in model.named_parameters()]
    reference = conveyor.materialize(copy.deepcopy(model), init_seed=SEED)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    pipe = conveyor.Pipeline(
        model, loss_fn=F.mse_loss, microbatches=2, schedule="auto", sample=(x, y),
        init_seed=SEED,
    )  # fmt: skip
    assert pipe.plan is not None
    held = dict(pipe.named_parameters())
    equal = all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in held.items())
    real_elsewhere = [n for n in names if n not in held and not model.get_parameter(n).is_meta]
    # Nothing else real is left alive: the references' stages were dropped.
    known = {id(p) for p in (*held.values(), *reference.parameters())}
    gc.collect()
    leftover = [i for i in _real_parameter_bytes() if i not in known]
    return {
        "calibrated": pipe.plan.calibration is not None,
        "held": sorted(held),
        "equal": equal,
        "real elsewhere": real_elsewhere,
        "references": references,
        "leftover": leftover,
    }


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_calibrating_a_meta_model_makes_real_only_the_ranks_own_stages() -> None:
    # Spawned: the check walks every live parameter, and a forked worker would inherit
    # the test process's (other tests' models).
    results = distributed.run(_calibrated, 2)
    for r in results:
        assert r["calibrated"] and r["equal"] and r["real elsewhere"] == [], r
        assert r["leftover"] == [], r
        # Each reference pipeline made real exactly this rank's stages of it.
        assert r["references"] and all(real == own > 0 for real, own in r["references"]), r
    assert sorted(results[0]["held"] + results[1]["held"]) == sorted(
        n for n, _ in uneven().named_parameters()
    )


def test_a_released_unit_copy_frees_its_parameters_at_once() -> None:
    # The unit copies are released as soon as they are timed: their parameters die with
    # the last reference (a graph module's own cycle keeps nothing alive).
    with conveyor.empty_weights():
        model = tiny_gpt()
    made: list[weakref.ref[nn.Parameter]] = []
    real = RealUnits(model, torch.device("cpu"), SEED)
    for unit in profiler.units(model):
        copy_ = real.real(unit)
        assert not any(p.is_meta for p in copy_.parameters())
        made += [weakref.ref(p) for p in copy_.parameters()]
        release(copy_)
        del copy_
        assert all(r() is None for r in made)


class Scale(nn.Module):
    """A layer with no ``reset_parameters``: only a checkpoint can give it values."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_auto_on_a_meta_model_reads_its_units_from_weights(tmp_path: Path) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 16), Scale(16), nn.Tanh(), nn.Linear(16, 8), Scale(8))

    real, meta = built_twice(build)
    with torch.no_grad():
        for p in real.parameters():
            p.add_(torch.randn_like(p))
    conveyor.save(real, tmp_path / "ckpt")
    conveyor.init(pp=2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = conveyor.Pipeline(
        meta, loss_fn=F.mse_loss, microbatches=2, schedule="auto", sample=(x, y),
        weights=tmp_path / "ckpt",
    )  # fmt: skip
    expected = dict(real.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_meta_unit_nothing_can_initialize_is_named_before_profiling() -> None:
    with conveyor.empty_weights():
        model = nn.Sequential(nn.Linear(8, 8), Scale(8), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(ConfigError, match=r"1\.gain .*Scale.*reset_parameters"):
        plan(model, x, y, F.mse_loss, 2, calibrate=False)
