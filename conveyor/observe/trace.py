"""Timings of real runs: per-action records and what the simulator can learn from them.

Pure Python (no torch import).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from conveyor.runtime.timing import Timing


def measured_costs(timings: Iterable[Timing], stages: int) -> list[tuple[float, float, float]]:
    """Per stage, the mean duration of its F, B and W actions in ``timings`` (0 if none).

    The result is the per-stage cost list :func:`conveyor.simulate.simulate` takes, so a
    real run can be replayed in simulated time.
    """
    sums = [[0.0, 0.0, 0.0] for _ in range(stages)]
    counts = [[0, 0, 0] for _ in range(stages)]
    for _, kind, stage, _, start, end in timings:
        k = "FBW".index(kind)
        sums[stage][k] += end - start
        counts[stage][k] += 1
    return [
        (s[0] / max(c[0], 1), s[1] / max(c[1], 1), s[2] / max(c[2], 1))
        for s, c in zip(sums, counts, strict=True)
    ]


def measured_bubble(timings: Iterable[Timing], ranks: int) -> float:
    """1 - busy time / (ranks x the span from the first start to the last end)."""
    rows = list(timings)
    if not rows:
        return 0.0
    busy = sum(end - start for *_, start, end in rows)
    wall = max(r[5] for r in rows) - min(r[4] for r in rows)
    return 1.0 - busy / (ranks * wall) if wall > 0 else 0.0


def chrome_trace(
    timings: Iterable[Timing], waits: Iterable[Timing], info: dict[str, object]
) -> dict[str, object]:
    """A Chrome trace (``chrome://tracing``, Perfetto): a track per rank, an event per
    action and per wait for a transfer; ``info`` goes to ``otherData``."""
    events: list[dict[str, object]] = []
    ranks: set[int] = set()
    for rank, kind, stage, mb, start, end in timings:
        ranks.add(rank)
        events.append({
            "name": f"{kind}{mb}", "cat": kind, "ph": "X", "pid": 0, "tid": rank,
            "ts": start * 1e6, "dur": (end - start) * 1e6,
            "args": {"kind": kind, "stage": stage, "microbatch": mb},
        })
    for rank, kind, stage, mb, start, end in waits:
        what = "activations" if kind == "F" else "gradients"
        events.append({
            "name": f"wait {what} {kind}{stage},{mb}", "cat": "wait", "ph": "X", "pid": 0,
            "tid": rank, "ts": start * 1e6, "dur": (end - start) * 1e6,
            "args": {"waits_for": kind, "stage": stage, "microbatch": mb},
        })
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted(ranks)
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": info}


def actions_of(trace: dict[str, Any]) -> list[Timing]:
    """The action events of a trace made by :func:`chrome_trace`, in start order."""
    rows = [
        Timing(e["tid"], e["args"]["kind"], e["args"]["stage"], e["args"]["microbatch"],
               e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in trace["traceEvents"] if e.get("cat") in ("F", "B", "W")
    ]
    return sorted(rows, key=lambda r: (r.start, r.rank))


def read_trace(path: str) -> dict[str, Any]:
    """The trace in ``path``, checked.

    Args:
        path: a file written by ``pipe.save_trace(path)``.

    Returns:
        The trace as a dict (Chrome trace JSON).

    Raises:
        ConfigError: in one sentence, when the file is missing or is not such a trace.
    """
    from conveyor.errors import ConfigError

    try:
        with open(path) as f:
            trace = json.load(f)
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError("no traceEvents list")
        if not isinstance(trace.get("otherData", {}), dict):
            raise ValueError("otherData is not an object")
        actions_of(trace)  # every action event has what the picture needs
    except FileNotFoundError:
        raise ConfigError(
            f"no file {path}; pass a trace written by pipe.save_trace(path)"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"{path} is not a trace written by pipe.save_trace(path) (a Chrome trace JSON "
            "with conveyor's action events)"
        ) from None
    return trace
