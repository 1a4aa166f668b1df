"""Timeline pictures (PNG) of simulated or measured runs; needs matplotlib."""

from __future__ import annotations

import os
from collections.abc import Iterable

from conveyor.errors import ConfigError

TimelineEvent = tuple[int, str, int, int, float, float]
"""(rank, kind, stage, microbatch, start, end)."""

_COLOURS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b"}


def draw_timeline(
    events: Iterable[TimelineEvent], path: str | os.PathLike[str], title: str = ""
) -> None:
    """Draw one row per rank, one box per action, coloured by kind, labelled by micro-batch.

    ``events`` are plain (rank, kind, stage, microbatch, start, end) tuples, so both
    simulated and measured timelines can be drawn. Later stages of a rank are drawn
    lighter. Raises :class:`~conveyor.errors.ConfigError` when matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("drawing a PNG needs matplotlib; pip install matplotlib") from None
    rows = list(events)
    ranks = max((e[0] for e in rows), default=0) + 1
    stages = max((e[2] for e in rows), default=0) + 1
    chunks = max(1, stages // ranks)
    begin = min((e[4] for e in rows), default=0.0)
    finish = max((e[5] for e in rows), default=1.0)
    length = max(finish - begin, 1e-9)

    figure = Figure(figsize=(min(max(8.0, 0.25 * len(rows) / ranks), 30.0), 1.0 + 0.5 * ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for rank, kind, stage, microbatch, start, end in rows:
        chunk = min(stage // ranks, chunks - 1)
        axes.barh(
            rank,
            end - start,
            left=start - begin,
            height=0.8,
            color=_COLOURS.get(kind, "#999999"),
            alpha=1.0 - 0.45 * chunk / max(chunks - 1, 1),
            edgecolor="white",
            linewidth=0.5,
        )
        if (end - start) / length > 0.008:
            axes.text(
                start - begin + (end - start) / 2,
                rank,
                str(microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    axes.set_xlim(0, length)
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_xlabel("time")
    if title:
        axes.set_title(title, loc="left", fontsize=10)
    kinds = sorted({e[1] for e in rows}, key="FBW".find)
    axes.legend(
        handles=[Patch(color=_COLOURS.get(k, "#999999"), label=k) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),  # right of the plot, clear of a long title
        ncol=1,
        frameon=False,
        fontsize=8,
    )
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=120)
