"""``conveyor trace FILE.json --png FILE.png``: draw a trace saved by ``pipe.save_trace``."""

from __future__ import annotations

import sys

from conveyor.cli._args import HelpFormatter, Parser
from conveyor.errors import ConfigError
from conveyor.observe.pictures import WAIT, draw_timeline
from conveyor.observe.trace import actions_of, read_trace
from conveyor.runtime.timing import Timing


def main(argv: list[str] | None = None) -> int:
    """Run ``conveyor trace``: draw a trace saved by ``pipe.save_trace(path)`` as a PNG.

    Args:
        argv: The arguments after ``conveyor trace`` (default: ``sys.argv[1:]``):
            ``FILE.json --png FILE.png``.

    Returns:
        The exit code: 0 when drawn, 2 for a bad file or path (printed in one line).

    Raises:
        SystemExit: For ``--help`` (code 0) and for a usage error (code 2, printed in
            one line).
    """
    parser = Parser(
        prog="conveyor trace",
        description="Draw a trace saved by pipe.save_trace(path) as a timeline: a row per rank, "
        "time in ms, grey where a rank waited for a transfer.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("file", help="a trace written by pipe.save_trace(path)")
    parser.add_argument("--png", required=True, metavar="FILE", help="the picture to write")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.file)
        info = trace.get("otherData", {})
        waits = [
            Timing(
                e["tid"],
                WAIT,
                e["args"]["stage"],
                e["args"]["microbatch"],
                e["ts"] / 1e6,
                (e["ts"] + e["dur"]) / 1e6,
            )
            for e in trace["traceEvents"]
            if e.get("cat") == "wait"
        ]
        chunks = info.get("chunks", "?")
        title = (
            f"{info.get('schedule', '?')}: {info.get('ranks', '?')} ranks x {chunks} "
            f"chunk(s), {info.get('microbatches', '?')} micro-batches; bubble measured "
            f"{info.get('measured_bubble', float('nan')):.3f}, simulated "
            f"{info.get('simulated_bubble', float('nan')):.3f}"
        )
        in_ms = [
            t._replace(start=t.start * 1e3, end=t.end * 1e3) for t in actions_of(trace) + waits
        ]
        draw_timeline(in_ms, args.png, title, unit="ms")
    except ConfigError as error:
        print(f"conveyor trace: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.png}")
    return 0
