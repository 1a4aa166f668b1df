"""Predictions against published runs (benchmarks/predictions.py, docs/predictions.md):
rows of each source predicted here, fast, must be the page's lines; the whole page is the
script's output (slow)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "predictions.md"


@pytest.fixture(scope="module")
def predictions() -> Iterator[Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import predictions as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    yield module


def _block(name: str) -> str:
    page = PAGE.read_text()
    return page.split(f"<!-- {name} -->\n")[1].split(f"\n<!-- /{name} -->")[0]


FAST = [  # (source, label, schedule): one setting or row of each source
    ("zb-table4", "6.2B m=24", None),
    ("megatron-table1", "1.7B", None),
    ("megatron-table1", "145.6B", None),
    ("torchtitan-405b", "405B 512xH100 FSDP8 TP8 PP8", None),
    ("llama3-table4", "16384 GPUs seq 8192", None),
    ("llama3-table4", "16384 GPUs seq 131072", None),
]


def test_rows_of_every_source_are_the_pages(predictions: Any) -> None:
    table = _block("predictions-table")
    for source, label, _ in FAST:
        runs = [r for r in predictions.RUNS if r.source == source and r.label == label]
        assert runs, (source, label)
        for run in runs:
            assert predictions.line(predictions.predict(run)) in table, (source, label)


def test_every_published_row_is_on_the_page(predictions: Any) -> None:
    table = _block("predictions-table")
    for run in predictions.RUNS:
        assert f"| {run.model.name}, {run.label} |" in table
    assert {run.source for run in predictions.RUNS} == set(predictions.SOURCES)


def test_the_targets_are_the_issues(predictions: Any) -> None:
    assert (predictions.MEMORY, predictions.THROUGHPUT, predictions.RATIO) == (0.15, 0.20, 0.05)
    row = predictions.Row(
        predictions.RUNS[0], {"memory_gb": (1.16, 1.0), "samples_per_s_per_gpu": (0.79, 1.0)}
    )
    assert "**miss**" in predictions._cell(row, "memory_gb")
    assert "**miss**" in predictions._cell(row, "samples_per_s_per_gpu")
    row = predictions.Row(
        predictions.RUNS[0], {"memory_gb": (1.14, 1.0), "samples_per_s_per_gpu": (0.81, 1.0)}
    )
    assert "miss" not in predictions._cell(row, "memory_gb") + predictions._cell(
        row, "samples_per_s_per_gpu"
    )


@pytest.mark.slow
def test_the_page_is_the_scripts_output(predictions: Any) -> None:
    rows = [predictions.predict(run) for run in predictions.RUNS]
    assert _block("predictions-table") == predictions.table(rows)
    assert _block("predictions-summary") == predictions.summary(rows)
    assert _block("predictions-stages") == predictions.stages()


def test_every_miss_names_its_cause_and_every_row_its_framework(predictions: Any) -> None:
    table = _block("predictions-table")
    misses = [line for line in table.splitlines() if "**miss**" in line]
    assert misses
    tags = [t for line in misses for t in line.split("**miss** [")[1:]]
    assert len(tags) == sum(line.count("**miss**") for line in misses)
    for tag in tags:
        cause = tag.split("]")[0]
        assert cause in predictions.CAUSES and cause != "unexplained", tag
        assert f"- [{cause}] " in table  # its legend
    for run in predictions.RUNS:
        assert f"| {run.model.name}, {run.label} | {run.framework} |" in table
        assert f"- `{run.framework}`: " in table
