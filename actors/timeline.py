"""`cadence trace timeline`: the schedule, drawn from a server's debug log.

`read_timeline` parses the JSON lines that `cadence serve --log-format json
--log-level debug` writes (one `step` event per engine step, see actors/tracing.py)
and needs nothing beyond the standard library; `draw` turns them into a PNG with
matplotlib, an optional extra (`pip install 'cadence[plot]'`).

The x axis is time, not step index: a step computing a prefill chunk can take ten
times as long as a decode-only one, and idle gaps between bursts are part of the
schedule, so equal-width steps would hide both.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.errors import CadenceError

import attrs

from actors.atomic_write import write_atomically

# Formats matplotlib writes by itself: others need Pillow plugins or LaTeX.
IMAGE_FORMATS = ("png", "svg", "pdf")

# Past this, matplotlib's tick arithmetic overflows on finite values (1.7e308 ms); no
# real step count, token count or time comes near it.
MAX_DRAWN = 2.0**53
# A log line longer than this is no step event: read in pieces, each skipped, so a file
# of one endless line (or /dev/zero) cannot take the memory.
MAX_LINE_CHARS = 1 << 20

# What a step event must carry for the picture (besides its timestamp).
FIELDS = ("step", "rows", "prefill_tokens", "decode_rows", "cached_tokens", "preempted", "step_ms")


@attrs.frozen
class StepSample:
    step: int
    start_s: float  # since the first step in the log started
    step_ms: float
    rows: int
    prefill_tokens: int
    decode_rows: int  # also the step's decode tokens: one each
    cached_tokens: int  # prompt tokens the step's new rows took from the prefix cache
    preempted: int  # rows requeued by recompute while planning this step

    @property
    def end_s(self) -> float:
        return self.start_s + self.step_ms / 1e3


@attrs.frozen
class Timeline:
    steps: tuple[StepSample, ...]
    max_batch: int | None = None  # from the server's `ready` event, when the log has it


def read_timeline(path: Path) -> Timeline:
    """Every step event in the log, in order; other lines (not JSON, other events) are skipped.

    A step event whose numbers cannot be drawn (NaN, negative, too large for a float)
    is a CadenceError naming its line: a picture of a corrupt log would mislead."""
    max_batch = None
    raw = []  # (when the step ended, its event): only step events are kept, as a log
    try:  # of a long-running server is mostly other lines
        if not stat.S_ISREG(path.stat().st_mode):
            raise CadenceError(f"{path}: not a regular file")
        with path.open(encoding="utf-8", errors="replace") as log:
            pieces = iter(lambda: log.readline(MAX_LINE_CHARS), "")
            for number, line in enumerate(pieces, 1):
                if (e := _event(line)) is None:
                    continue
                if e.get("event") == "ready" and max_batch is None:
                    max_batch = e.get("max_batch")
                elif (end := _step_end(e, f"{path}:{number}")) is not None:
                    raw.append((end, e))
    except OSError as error:
        raise CadenceError(f"{path}: {error.strerror or error}") from None
    if not raw:
        raise CadenceError(
            f"{path}: no step events (log with `cadence serve --log-format json --log-level debug`)"
        )
    origin = min(end - e["step_ms"] / 1e3 for end, e in raw)
    steps = tuple(
        StepSample(
            step=e["step"],
            start_s=end - e["step_ms"] / 1e3 - origin,
            step_ms=e["step_ms"],
            rows=e["rows"],
            prefill_tokens=e["prefill_tokens"],
            decode_rows=e["decode_rows"],
            cached_tokens=e["cached_tokens"],
            preempted=e["preempted"],
        )
        for end, e in raw
    )
    is_count = isinstance(max_batch, int) and _is_drawable(max_batch) and max_batch > 0
    return Timeline(steps, max_batch if is_count else None)


def _event(line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):  # nested past Python's limit: not a step event either
        return None
    return event if isinstance(event, dict) else None


def _step_end(event: dict[str, Any], where: str) -> float | None:
    """When a well-formed step event's step ended, in POSIX seconds; None for anything else,
    and a CadenceError naming `where` for a step event whose numbers cannot be drawn."""
    if event.get("event") != "step" or not all(
        isinstance(event.get(name), int | float) for name in FIELDS
    ):
        return None
    try:
        end = datetime.fromisoformat(event["timestamp"]).timestamp()
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    for name in FIELDS:
        if not _is_drawable(event[name]):
            shown = repr(event[name])
            shown = shown if len(shown) <= 20 else f"{shown[:17]}..."
            raise CadenceError(
                f"{where}: a step event's {name} is {shown}, not a number in [0, 2**53]"
            )
    # The two are drawn stacked: each may be drawable while their sum is not.
    if not _is_drawable(event["prefill_tokens"] + event["decode_rows"]):
        raise CadenceError(f"{where}: a step event's prefill_tokens + decode_rows is past 2**53")
    return end


def _is_drawable(value: int | float) -> bool:
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        return False
    return 0 <= number <= MAX_DRAWN  # NaN fails both


def _boxes(steps: tuple[StepSample, ...], values: list[float]) -> tuple[list[float], list[float]]:
    """A closed outline per step, [start, end) at its value, zero between steps."""
    xs: list[float] = []
    ys: list[float] = []
    for step, value in zip(steps, values, strict=True):
        xs += [step.start_s, step.start_s, step.end_s, step.end_s]
        ys += [0.0, value, value, 0.0]
    return xs, ys


def draw(timeline: Timeline, output: Path) -> None:
    """Rows, decode and prefill tokens (stacked) and step time over one time axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    steps = timeline.steps
    fig, (rows_ax, tokens_ax, ms_ax) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 6.5), height_ratios=(1, 1.4, 1), layout="constrained"
    )
    rows_ax.fill(*_boxes(steps, [s.rows for s in steps]), color="tab:blue", lw=0)
    if timeline.max_batch is not None:
        rows_ax.axhline(timeline.max_batch, color="grey", ls="--", lw=0.8, label="--max-batch")
        rows_ax.legend(loc="upper right", fontsize="small")
    rows_ax.set_ylabel("rows")

    decode = [float(s.decode_rows) for s in steps]
    total = [float(s.decode_rows + s.prefill_tokens) for s in steps]
    tokens_ax.fill(*_boxes(steps, total), color="tab:orange", lw=0, label="prefill tokens")
    tokens_ax.fill(*_boxes(steps, decode), color="tab:green", lw=0, label="decode tokens")
    tokens_ax.set_ylabel("tokens computed")
    tokens_ax.legend(loc="upper right", fontsize="small")

    starts, ends = [s.start_s for s in steps], [s.end_s for s in steps]
    ms_ax.hlines([s.step_ms for s in steps], starts, ends, color="tab:purple", lw=1.5)
    ms_ax.set_ylabel("step ms")
    ms_ax.set_xlabel("seconds since the first step")

    preempted_at = [s.start_s for s in steps if s.preempted]
    for ax in (rows_ax, tokens_ax, ms_ax):
        ax.set_ylim(bottom=0)
        ax.vlines(preempted_at, 0, 1, transform=ax.get_xaxis_transform(), colors="red", lw=0.8)
    num_preempted = sum(s.preempted for s in steps)
    cached = sum(s.cached_tokens for s in steps)
    rows_ax.set_title(
        f"{len(steps)} steps, {sum(total):.0f} tokens computed, {cached} prompt tokens "
        f"from the prefix cache, {num_preempted} preemptions (red)",
        fontsize="medium",
    )
    try:
        write_atomically(output, lambda temporary: fig.savefig(temporary, dpi=80))
    finally:
        plt.close(fig)


def add_parser(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser("trace", help="pictures from a server's JSON debug log")
    which = trace.add_subparsers(dest="trace", required=True, parser_class=type(trace))
    timeline = which.add_parser(
        "timeline", help="rows, prefill/decode tokens and step time of every engine step"
    )
    timeline.add_argument(
        "log", type=Path, help="from `cadence serve --log-format json --log-level debug`"
    )
    timeline.add_argument(
        "-o",
        "--output",
        type=image_path,
        default=Path("timeline.png"),
        help="the image file; its suffix picks the format: .png, .svg or .pdf",
    )
    timeline.set_defaults(run=run)


def image_path(text: str) -> Path:
    """An image file named as it will be written: matplotlib would add ".png" to a name
    without a suffix (to a directory's name too), so the file written would not be the
    file named."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not an image file")
    if path.suffix[1:].lower() not in IMAGE_FORMATS:
        suffixes = ", ".join(f".{f}" for f in IMAGE_FORMATS)
        raise argparse.ArgumentTypeError(f"{text!r}: the image's suffix must be one of {suffixes}")
    return path


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "cadence: error: drawing needs matplotlib: pip install 'cadence[plot]'", file=sys.stderr
        )
        return 2
    try:
        timeline = read_timeline(args.log)
        draw(timeline, args.output)
    except CadenceError as error:
        print(f"cadence: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the output cannot be written
        print(f"cadence: error: {args.output}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(timeline.steps)} steps")
    return 0
