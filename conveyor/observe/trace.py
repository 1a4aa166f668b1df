"""Timings of real runs: per-action records and what the simulator can learn from them.

Pure Python (no torch import).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from conveyor.runtime.timing import Timing
from conveyor.schedules.simulation import bubble


def measured_costs(timings: Iterable[Timing], stages: int) -> list[tuple[float, float, float]]:
    """Per stage, the mean duration of its F, B and W actions in ``timings``.

    Args:
        timings: Action records of a real run (no waits).
        stages: Total number of stages.

    Returns:
        One (F, B, W) per stage, in the unit of ``timings`` (seconds for a pipeline's
        records), 0 for a kind with no record: the per-stage cost list
        :func:`conveyor.simulate.simulate` takes, so a real run can be replayed in
        simulated time.
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
    """The bubble (:func:`~conveyor.schedules.simulation.bubble`, the simulator's
    definition) of the actions in ``timings``.

    Args:
        timings: Action records of a real run (no waits), of every rank.
        ranks: Pipeline ranks.

    Returns:
        The bubble; 0 if there are no records.
    """
    rows = list(timings)
    if not rows:
        return 0.0
    busy = sum(t.end - t.start for t in rows)
    return bubble(busy, min(t.start for t in rows), max(t.end for t in rows), ranks)


def chrome_trace(
    timings: Iterable[Timing],
    waits: Iterable[Timing],
    info: dict[str, object],
    sizes: Mapping[tuple[str, int, int], Mapping[str, int]] | None = None,
) -> dict[str, object]:
    """A Chrome trace (``chrome://tracing``, Perfetto) of a real run.

    Args:
        timings: The action records.
        waits: The records of waits for a transfer (kind: what was waited for), and of
            expert all-to-alls (kind ``"A"``: the stage and micro-batch of the action that
            posted it), drawn from their post to their end.
        info: Anything to keep with the trace (schedule, sizes, bubbles); goes to
            ``otherData``.
        sizes: Per (kind, stage, micro-batch), byte counts to add to that action's
            ``args`` (e.g. ``{"held_bytes": ...}``: :func:`~conveyor.observe.measure.
            action_bytes`).

    Returns:
        The trace as a JSON-ready dict: a track per rank, an event per action, per wait
        and per all-to-all, times in microseconds.
    """
    trace_events: list[dict[str, object]] = []
    ranks: set[int] = set()
    for rank, kind, stage, mb, start, end in timings:
        ranks.add(rank)
        trace_events.append(
            {
                "name": f"{kind}{mb}",
                "cat": kind,
                "ph": "X",
                "pid": 0,
                "tid": rank,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {
                    "kind": kind,
                    "stage": stage,
                    "microbatch": mb,
                    **(sizes or {}).get((kind, stage, mb), {}),
                },
            }
        )
    for rank, kind, stage, mb, start, end in waits:
        args: dict[str, object]
        if kind == "A":  # an expert all-to-all, from its post to its end
            name, cat, args = f"all-to-all {stage},{mb}", "all-to-all", {"by_stage": stage}
        else:
            what = "activations" if kind == "F" else "gradients"
            name, cat, args = f"wait {what} {kind}{stage},{mb}", "wait", {"waits_for": kind}
        trace_events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": 0,
                "tid": rank,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {**args, "stage": stage, "microbatch": mb},
            }
        )
    trace_events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted(ranks)
    ]
    return {"traceEvents": trace_events, "displayTimeUnit": "ms", "otherData": info}


def actions_of(trace: dict[str, Any]) -> list[Timing]:
    """The action events of a trace made by :func:`chrome_trace`, back as records.

    Args:
        trace: The trace dict.

    Returns:
        One record per action (waits left out), times in seconds, by start time then
        rank.

    Raises:
        KeyError: If an action event lacks what :func:`chrome_trace` writes.
    """
    rows = [
        Timing(
            e["tid"],
            e["args"]["kind"],
            e["args"]["stage"],
            e["args"]["microbatch"],
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
        )
        for e in trace["traceEvents"]
        if e.get("cat") in ("F", "B", "W")
    ]
    return sorted(rows, key=lambda r: (r.start, r.rank))


def read_trace(path: str) -> dict[str, Any]:
    """The trace in ``path``, checked.

    Args:
        path: A file written by ``pipe.save_trace(path)``.

    Returns:
        The trace as a dict (Chrome trace JSON).

    Raises:
        ConfigError: In one sentence, when the file is missing or is not such a trace.
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
