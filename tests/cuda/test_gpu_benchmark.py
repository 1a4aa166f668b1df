"""``benchmarks/gpu.py --device cpu --quick`` runs (not timed: a smoke test on tiny sizes)
and its table and JSON hold every schedule beside the unsplit model, with memory that
orders as the schedules do (GPipe holds every micro-batch, 1F1B at most p)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_benchmark() -> object:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_runs_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _gpu_benchmark()
    out = tmp_path / "gpu.json"
    assert bench.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    names = ["unsplit", *bench.SCHEDULES]  # type: ignore[attr-defined]
    assert list(result["rows"]) == names
    for name in names:
        assert f"| {name} |" in printed
        row = result["rows"][name]
        assert row["ms"] > 0 and row["step_peak"] > 0 and row["device_peak"] is None, row
    peaks = {n: r["step_peak"] for n, r in result["rows"].items()}
    assert peaks["gpipe"] > peaks["1f1b"], peaks
