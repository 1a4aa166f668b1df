"""``benchmarks/vs_torch.py --schedules`` (the zero-bubble side by side) runs at a tiny width,
one step per round, untimed: every conveyor row and torch's ZB, ZBV and DualPipeV
schedules train the same first step as conveyor's, both libraries' activation memory is
measured, and the closing comparison picks each library's fastest (checked apart on
made-up rows)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its `from common import ...`
    spec = importlib.util.spec_from_file_location("vs_torch_bench", ROOT / "benchmarks/vs_torch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name: str, ours: float, theirs: float | None, torch_name: str | None,
         kib: tuple[int, int], torch_kib: tuple[int, int] | None,
         split: bool = True) -> dict[str, Any]:  # fmt: skip
    chunks = 2 if name in ("zbv", "dualpipev") else 1
    # Two rounds: the first at the median, the second 10% slower for conveyor.
    return {
        "conveyor_round_ms": [ours, ours * 1.1],
        "torch_round_ms": None if theirs is None else [theirs, theirs],
        "schedule": name, "chunks": chunks, "torch_schedule": torch_name, "conveyor_ms": ours,
        "torch_ms": theirs, "activation_bytes_measured": [k * 1024 for k in kib],
        "torch_activation_bytes": None if torch_kib is None else [k * 1024 for k in torch_kib],
        "split_backward": split,
    }  # fmt: skip


def test_fastest_picks_each_librarys_best_within_memory() -> None:
    bench = _bench()
    rows = [
        _row("1f1b", 100, 90, "Schedule1F1B", (320, 192), (320, 192), split=False),
        _row("zb-h1", 80, 110, "ScheduleInterleavedZeroBubble", (416, 512), (384, 384)),
        _row("zb-late", 60, None, None, (2048, 2048), None),
        _row("zbv", 85, 100, "ScheduleZBVZeroBubble", (416, 384), (416, 352)),
    ]
    got = bench.fastest(rows)
    assert got["torch_zero_bubble"] == {
        "name": "ScheduleZBVZeroBubble", "ms": 100, "activation_bytes": 416 * 1024,
        "round_ms": [100, 100],
    }  # fmt: skip
    assert got["torch_any"]["name"] == "Schedule1F1B"
    assert got["conveyor_zero_bubble"]["name"] == "zb-late"  # 1f1b is no zero-bubble row
    # Within ZBV's 416 KiB: zb-late (2048) and zb-h1 (512 on rank 1) are out.
    assert got["conveyor_within_memory"]["name"] == "zbv (chunks=2)"
    assert got["conveyor_within_memory/torch_zero_bubble"] == pytest.approx(0.85)
    assert got["conveyor_zero_bubble/torch_any"] == pytest.approx(60 / 90)
    assert got["conveyor_within_memory/torch_zero_bubble per round"] == pytest.approx([0.85, 0.935])
    text = bench.summary_line(got)
    assert "zbv (chunks=2) 85.0 ms (416 KiB)" in text and "Schedule1F1B 90.0 ms" in text
    line = "conveyor_within_memory/torch_zero_bubble: 0.85 (per round: median 0.89, 0.85 to 0.94)"
    assert line in text
    assert bench.per_round([0.1, 0.3, 0.2, 0.5, 0.4, 0.6], 2) == pytest.approx([200, 500])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_zero_bubble_side_by_side_runs(tmp_path: Path) -> None:
    out = tmp_path / "zb.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "benchmarks/vs_torch.py", "--schedules", "--width", "32", "--rounds",
         "1", "--steps", "1", "--warmup", "0", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    rows = {(r["schedule"], r["chunks"]): r for r in result["rows"]}
    bench = _bench()
    want = {("1f1b", 1), ("zb-h1", 1), ("zb-auto", 1), ("zbv", 2), ("zb-auto", 2), ("dualpipev", 2)}
    assert set(rows) == want
    torch_names = {r["torch_schedule"] for r in rows.values()} - {None}
    assert torch_names == {"Schedule1F1B", *bench.TORCH_ZERO_BUBBLE}
    # The same first step in both libraries, on every torch schedule (float32 rounding).
    assert result["max_weight_difference_after_one_step"] < 1e-5
    for row in rows.values():
        assert row["conveyor_ms"] > 0 and all(b > 0 for b in row["activation_bytes_measured"])
        if row["torch_schedule"] is not None:
            assert row["torch_ms"] > 0 and all(b > 0 for b in row["torch_activation_bytes"])
    # zb-auto is fitted to the measured costs under zb-h1's cap: p micro-batches per rank.
    assert max(rows["zb-auto", 1]["peak_microbatches"]) <= 2
    fastest = result["fastest"]
    assert fastest["torch_zero_bubble"]["name"] in bench.TORCH_ZERO_BUBBLE
    assert "conveyor_zero_bubble/torch_zero_bubble" in fastest
    assert "Fastest" in done.stdout
