"""Timeline pictures (PNG) of simulated or measured runs; needs matplotlib."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError
from conveyor.runtime.timing import Timing

WAIT = "wait"
"""The kind of an event that waited for a transfer (drawn grey, unlabelled)."""

VOCAB = ("E", "S", "T", "G")
"""The kinds of the vocabulary passes (each drawn in its own colour, every chunk alike)."""

_COLOURS = {
    "F": "#4c78a8",
    "B": "#59a14f",
    "W": "#f28e2b",
    "E": "#b07aa1",
    "S": "#e15759",
    "T": "#9c755f",
    "G": "#76b7b2",
    WAIT: "#b0b0b0",
}
_ORDER = ("F", "B", "W", *VOCAB, WAIT)  # the legend's order of kinds
_FONT = 7  # points, for the micro-batch numbers in the boxes
_DPI = 120


def _names(split_backward: bool) -> dict[str, str]:
    """The legend's words for each kind."""
    backward = "backward, input gradient" if split_backward else "backward"
    return {
        "F": "F: forward",
        "B": f"B: {backward}",
        "W": "W: weight gradient",
        "E": "E: embedding (vocabulary pass)",
        "S": "S: output forward and loss (vocabulary pass)",
        "T": "T: output backward (vocabulary pass)",
        "G": "G: embedding gradient (vocabulary pass)",
        WAIT: "waiting for a transfer",
    }


def _alpha(kind: str, stage: int, ranks: int, chunks: int) -> float:
    """A box's opacity: a rank's later chunks lighter; waits and passes solid."""
    if kind == WAIT or kind in VOCAB:
        return 1.0
    return _shade(min(stage // ranks, chunks - 1), chunks)


def _shade(chunk: int, chunks: int) -> float:
    """The opacity of a rank's ``chunk``-th stage: later chunks are lighter."""
    return 1.0 - 0.5 * chunk / max(chunks - 1, 1)


def _label_fits(label: str, box_px: float) -> bool:
    """Whether ``label`` fits a box ``box_px`` pixels wide."""
    # About 0.6 em per digit, plus a pixel of margin on each side.
    return len(label) * 0.6 * _FONT * _DPI / 72 + 2 <= box_px


def _check_folder(path: str | os.PathLike[str]) -> None:
    """ConfigError unless the folder ``path`` goes into exists."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(
            f"cannot write {os.fspath(path)}: folder {os.fspath(folder)} does not exist; "
            "create it or pick another path"
        )


def draw_timeline(
    events: Iterable[Timing],
    path: str | os.PathLike[str],
    title: str = "",
    unit: str = "time units",
) -> Any:
    """Draw a timeline as a PNG: one row per rank, one box per action, coloured by kind.

    A rank's later chunks are drawn lighter; the legend names every colour and shade. A
    box gets its micro-batch number where the number fits. Time starts at the earliest
    event.

    Args:
        events: Plain ``(rank, kind, stage, microbatch, start, end)`` tuples
            (:class:`~conveyor.runtime.timing.Timing`), so both simulated and measured
            timelines can be drawn; kind :data:`WAIT` is a wait for a transfer; kinds
            ``E``, ``S``, ``T`` and ``G`` (:data:`VOCAB`) are vocabulary passes, one
            event per rank (their stage is not used; -1 by convention).
        path: The PNG file to write.
        title: The picture's title; none when empty.
        unit: The unit of ``start`` and ``end``, for the time axis (``"ms"``,
            ``"cost units"``).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ConfigError: When matplotlib is missing, the folder of ``path`` does not exist,
            or the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("drawing a PNG needs matplotlib; pip install matplotlib") from None
    _check_folder(path)
    rows = list(events)
    ranks = max((e[0] for e in rows), default=0) + 1
    stages = max((e[2] for e in rows if e[1] not in VOCAB), default=0) + 1
    chunks = max(1, stages // ranks)
    begin = min((e[4] for e in rows), default=0.0)
    finish = max((e[5] for e in rows), default=1.0)
    length = max(finish - begin, 1e-9)
    kinds = sorted({e[1] for e in rows}, key=lambda k: (*_ORDER, k).index(k))
    names = _names("W" in kinds)

    figure = Figure(figsize=(min(max(8.0, 0.25 * len(rows) / ranks), 30.0), 1.2 + 0.5 * ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for rank, kind, stage, _, start, end in rows:
        axes.barh(
            rank,
            end - start,
            left=start - begin,
            height=0.8,
            color=_COLOURS.get(kind, "#999999"),
            alpha=_alpha(kind, stage, ranks, chunks),
            edgecolor="white",
            linewidth=0.5,
        )
    axes.set_xlim(0, length)
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_xlabel(f"time ({unit})")
    if title:
        axes.set_title(title, loc="left", fontsize=10)
    handles = [Patch(color=_COLOURS.get(k, "#999999"), label=names.get(k, k)) for k in kinds]
    if chunks > 1:
        handles += [
            Patch(color="#555555", alpha=_shade(c, chunks), label=f"chunk {c} of each rank")
            for c in range(chunks)
        ]
    axes.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),  # right of the plot, clear of a long title
        ncol=1,
        frameon=False,
        fontsize=8,
    )
    figure.tight_layout()
    # The layout is final now, so a box's width in pixels is known.
    axes_px = axes.get_position().width * figure.get_figwidth() * _DPI
    for rank, kind, stage, microbatch, start, end in rows:
        label = str(microbatch)
        if kind == WAIT or not _label_fits(label, (end - start) / length * axes_px):
            continue
        light = _alpha(kind, stage, ranks, chunks) < 0.75
        axes.text(
            start - begin + (end - start) / 2,
            rank,
            label,
            ha="center",
            va="center",
            fontsize=_FONT,
            color="black" if light else "white",
        )
    try:
        figure.savefig(os.fspath(path), dpi=_DPI)
    except OSError as error:
        raise ConfigError(f"cannot write {os.fspath(path)}: {error.strerror}") from None
    return figure
