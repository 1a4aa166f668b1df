"""benchmarks/published_runs.py is internally consistent: layouts multiply to the GPU count,
batches split into whole micro-batches, every source has its measured quantities, and the
published peaks agree with the hardware presets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import published_runs as pr
from conveyor.planning import PRESETS

KINDS = {"samples_per_s_per_gpu", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gb"}
SCHEDULES = {"1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto"}


@pytest.mark.parametrize("run", pr.RUNS, ids=lambda r: f"{r.source}:{r.label}:{r.schedule}")
def test_row_is_consistent(run: pr.Run) -> None:
    assert run.gpus == run.pp * run.tp * run.dp * run.cp
    assert run.global_batch % (run.microbatch_size * run.dp) == 0
    assert run.microbatches >= 1
    assert run.hardware in PRESETS
    assert run.schedule in SCHEDULES
    assert set(run.measured) <= KINDS
    assert all(value > 0 for value in run.measured.values())
    assert run.seq == run.model.seq or run.source in ("llama3-table4", "torchtitan-405b")
    assert run.model.layers >= run.pp
    if run.schedule == "zb-auto":
        assert run.microbatch_cap in (run.pp, 2 * run.pp)
    else:
        assert run.microbatch_cap is None
    if run.schedule == "interleaved-1f1b":
        assert run.chunks >= 2
    assert run.note and run.model.heads % run.model.kv_heads == 0


@pytest.mark.parametrize("key", sorted(pr.SOURCES))
def test_every_source_has_rows_with_its_measurements(key: str) -> None:
    runs = pr.by_source(key)
    assert len(runs) >= 3
    for run in runs:
        for kind in pr.SOURCES[key].kinds:
            assert kind in run.measured, (run.label, kind)


def test_table_sizes_and_pairs() -> None:
    assert len(pr.by_source("zb-table4")) == 4 * 3 * 4  # models x micro-batch counts x rows
    assert len(pr.by_source("megatron-table1")) == 10
    assert len(pr.by_source("torchtitan-405b")) == 2 + 4
    assert len(pr.by_source("llama3-table4")) == 3
    for runs in pr.settings("zb-table4").values():
        assert sorted((r.schedule, r.microbatch_cap or 0) for r in runs) == sorted(
            [
                ("1f1b", 0),
                ("interleaved-1f1b", 0),
                ("zb-auto", runs[0].pp),
                ("zb-auto", 2 * runs[0].pp),
            ]
        )
        assert len({(r.model, r.gpus, r.global_batch) for r in runs}) == 1
    with pytest.raises(KeyError):
        pr.by_source("nope")


def test_published_percentages_match_the_presets_peaks() -> None:
    for key in ("megatron-table1", "llama3-table4"):
        for run in pr.by_source(key):
            peak = PRESETS[run.hardware].peak_tflops
            assert run.measured["tflops_per_gpu"] / peak == pytest.approx(
                run.measured["mfu"], abs=0.01
            )


def test_llama3_batches_are_sixteen_million_tokens() -> None:
    for run in pr.by_source("llama3-table4"):
        assert run.global_batch * run.seq == 2**24


def test_megatron_equation_3_is_near_twelve_times_parameters_per_token() -> None:
    # With recomputation, F / (B s) is about 4 * (2 * 12 l h^2) = 96 l h^2 (the 1T row).
    run = pr.by_source("megatron-table1")[-1]
    per_token = pr.megatron_flops(run.model, 1) / run.seq
    assert per_token / (96 * run.model.layers * run.model.hidden**2) == pytest.approx(1.0, abs=0.03)
