"""``benchmarks/big_model.py --quick`` runs and its numbers make sense: a model built on
the meta device peaks lower on every rank than the model built whole, each rank holds real
values only for its own stages, and the initialized and loaded runs train (finite losses;
the loaded one is the saved whole model, so its loss is the whole path's). Saving: with
``conveyor.save_pretrained`` no rank's peak rises above what it held by more than its share
plus the largest tensor, gathered into rank 0 that rank's rises by the whole model, and
both directories load with ``from_pretrained`` as the model the runs built, bit for bit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_the_big_model_benchmark_runs_and_meta_paths_peak_lower(tmp_path: Path) -> None:
    out = tmp_path / "big.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "BIG_MODEL_DIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "benchmarks/big_model.py", "--quick", "--together", "--pp", "2",
         "--json", str(out), "--keep", str(tmp_path / "saved")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    runs = {run["path"]: run["ranks"] for run in result["runs"]}
    assert set(runs) == {"whole", "init", "load", "save", "gather"}
    assert all(len(ranks) == 2 for ranks in runs.values()), runs
    whole_peak = max(r["peak"] for r in runs["whole"])
    for path in ("init", "load"):
        assert max(r["peak"] for r in runs[path]) < whole_peak, (path, runs)
        for r in runs[path]:
            assert math.isfinite(r["loss"]), (path, r)
            assert r["real_elsewhere"] == 0, (path, r)  # the other stages stayed meta
    assert runs["load"][0]["loss"] == pytest.approx(runs["whole"][0]["loss"], rel=1e-5)
    # The ranks' shares add up to the model: parameters and their gradients.
    assert sum(r["params"] for r in runs["init"]) == result["model"]["bytes"]

    # Saving: per rank, no more than its share and one tensor; gathered, the whole model.
    model = result["model"]["bytes"]
    for r in runs["save"]:
        assert r["peak"] - r["rss_before"] <= r["share"] + r["largest"], r
    assert runs["gather"][0]["peak"] - runs["gather"][0]["rss_before"] >= model, runs["gather"]
    assert sum(r["share"] for r in runs["save"]) == model
    check_saved(tmp_path / "saved", ("save-pp2", "gather-pp2"))


def check_saved(root: Path, names: tuple[str, ...]) -> None:
    """Each directory is what the runs built (the model initialized with init_seed=0),
    read by transformers' from_pretrained, bit for bit."""
    import torch
    from transformers import LlamaForCausalLM

    import conveyor

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import big_model
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with conveyor.empty_weights():
        expected = LlamaForCausalLM(big_model.config(big_model.QUICK))
    conveyor.materialize(expected, init_seed=0)
    want = expected.state_dict()
    for name in names:
        got = LlamaForCausalLM.from_pretrained(root / name).state_dict()
        assert set(got) == set(want), name
        for key, value in want.items():
            assert torch.equal(got[key], value), (name, key)
