"""``conveyor launch -m conveyor.verify``: the one command a user runs to check conveyor
on their devices (the README's GPU section names it); here on 2 gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "conveyor.launch", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, "-m", "conveyor.verify", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_every_schedule_matches_the_unsplit_model() -> None:
    done = _verify("--schedules", "1f1b,zbv,dualpipev")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "conveyor.verify: 2 processes, gloo on cpu, pp=2 dp=1", lines
    for name in ("1f1b", "zbv", "dualpipev"):
        row = next(line for line in lines if line.split()[:1] == [name])
        assert row.split()[1] == "ok", row
        assert float(row.split()[5]) < 1e-5, row
    assert lines[-1] == "conveyor.verify: every schedule matches"


def test_a_difference_beyond_the_tolerance_fails_the_check() -> None:
    # Float sums in another order differ by ~1e-7: a tolerance of 0 must report them.
    done = _verify("--schedules", "1f1b", "--tolerance", "0")
    assert done.returncode != 0, done.stdout
    assert "DIFFERS" in done.stdout and "conveyor.verify: FAILED" in done.stdout, done.stdout
