"""`cadence trace timeline`: parsing a server's JSON debug log, and drawing it."""

import json
import subprocess
import sys
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path

from runtime.errors import CadenceError

import pytest

from actors import timeline
from actors.cli import _parser
from actors.timeline import FIELDS, StepSample, Timeline, _boxes, draw, read_timeline

CLI = [sys.executable, "-m", "actors.cli"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def step_line(step, end_s, step_ms, rows, prefill_tokens, decode_rows, cached=0, preempted=0):
    event = {
        "step": step,
        "rows": rows,
        "tokens": prefill_tokens + decode_rows,
        "prefill_rows": rows - decode_rows,
        "prefill_tokens": prefill_tokens,
        "decode_rows": decode_rows,
        "cached_tokens": cached,
        "preempted": preempted,
        "free_blocks": 10,
        "prefix_hit_rate": 0.0,
        "step_ms": step_ms,
        "event": "step",
        "level": "debug",
        "timestamp": (T0 + timedelta(seconds=end_s)).isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(event)


def write_log(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_only_step_events_become_steps_timed_from_the_first_steps_start(tmp_path):
    log = write_log(
        tmp_path / "serve.jsonl",
        [
            "Traceback (most recent call last):",
            "",
            '{"url": "http://x", "max_batch": 16, "event": "ready", "timestamp": "2026-01-01T00:00:00Z"}',
            step_line(
                1, end_s=10.5, step_ms=500, rows=2, prefill_tokens=96, decode_rows=0, cached=32
            ),
            '{"request_id": "r1", "event": "first_token", "ttft_ms": 3}',
            "[1, 2, 3]",
            '{"step": "loading weights", "event": "loading"}',  # a `step` key, not a step event
            step_line(2, end_s=10.75, step_ms=250, rows=3, prefill_tokens=40, decode_rows=2),
            step_line(
                3, end_s=11.0, step_ms=100, rows=2, prefill_tokens=0, decode_rows=2, preempted=1
            ),
            '{"step": 4, "event": "step", "step_ms": 5}',  # from an older cadence: fields missing
            json.dumps({**json.loads(step_line(5, 11.5, 10, 1, 0, 1)), "rows": "1"}),  # a string
            json.dumps({**json.loads(step_line(6, 11.5, 10, 1, 0, 1)), "timestamp": "soon"}),
        ],
    )
    timeline = read_timeline(log)
    assert timeline.max_batch == 16
    assert timeline.steps == (
        StepSample(1, 0.0, 500, 2, 96, 0, 32, 0),
        StepSample(2, pytest.approx(0.5), 250, 3, 40, 2, 0, 0),
        StepSample(3, pytest.approx(0.9), 100, 2, 0, 2, 0, 1),
    )
    assert timeline.steps[1].end_s == pytest.approx(0.75)


def test_the_drawing_is_a_png(tmp_path):
    steps = tuple(
        StepSample(
            i,
            i * 0.1,
            100.0,
            rows=i % 5,
            prefill_tokens=(i % 3) * 40,
            decode_rows=i % 5,
            cached_tokens=0,
            preempted=int(i == 7),
        )
        for i in range(20)
    )
    output = tmp_path / "timeline.png"
    draw(Timeline(steps, max_batch=4), output)
    data = output.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def run_cli(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_a_line_nested_past_pythons_limit_is_skipped_like_any_other_line(tmp_path):
    deep = "[" * 100_000  # json.loads raises RecursionError, not ValueError
    step = step_line(1, end_s=1.0, step_ms=10, rows=1, prefill_tokens=5, decode_rows=0)
    log = write_log(tmp_path / "serve.jsonl", [deep, '{"a": ' * 100_000, step])
    (only,) = read_timeline(log).steps
    assert only.step == 1 and only.prefill_tokens == 5


def test_a_missing_log_or_one_without_steps_is_one_error_line_and_status_2(tmp_path):
    no_steps = write_log(tmp_path / "info.jsonl", ['{"event": "ready"}', "not json"])
    # /dev/zero, one endless line, is refused as no regular file, as /dev/null is.
    for log in (tmp_path / "absent.jsonl", no_steps, Path("/dev/null"), Path("/dev/zero")):
        result = run_cli("trace", "timeline", str(log), "-o", str(tmp_path / "t.png"))
        assert result.returncode == 2
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"cadence: error: {log}")
    assert not (tmp_path / "t.png").exists()


def test_without_matplotlib_it_says_which_extra_to_install(tmp_path):
    log = write_log(tmp_path / "serve.jsonl", [step_line(1, 1.0, 10, 1, 5, 0)])
    hide = "import sys; sys.modules['matplotlib'] = None; from actors.cli import main; "
    argv = ["trace", "timeline", str(log), "-o", str(tmp_path / "t.png")]
    result = subprocess.run(
        [sys.executable, "-c", f"{hide}sys.exit(main({argv!r}))"], capture_output=True, text=True
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "pip install 'cadence[plot]'" in line


def test_a_real_debug_log_has_every_field_the_timeline_needs(tiny, tmp_path):
    generate = ["generate", "Hello there", "--model", str(tiny), "--max-tokens", "6"]
    result = run_cli(*generate, "--log-format", "json", "--log-level", "debug")
    assert result.returncode == 0, result.stderr
    log = write_log(tmp_path / "generate.jsonl", result.stderr.splitlines())
    steps = [e for e in map(json.loads, result.stderr.splitlines()) if e["event"] == "step"]
    assert steps and all({*FIELDS, "timestamp"} <= set(e) for e in steps)
    assert all(e["prefill_tokens"] + e["decode_rows"] == e["tokens"] for e in steps)
    timeline = read_timeline(log)
    assert len(timeline.steps) == len(steps)
    first, *rest = timeline.steps
    assert first.prefill_tokens > 0 and first.decode_rows == 0
    assert sum(s.decode_rows for s in rest) >= 5  # the tokens after the first
    drawn = run_cli("trace", "timeline", str(log), "-o", str(tmp_path / "t.png"))
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("max_batch", ['"16"', "0", "-3", "1" + "0" * 400])
def test_a_ready_event_whose_max_batch_is_no_row_count_draws_no_cap_line(tmp_path, max_batch):
    """10**400 rows overflowed matplotlib (a traceback); "16" or 0 is no row count either."""
    ready = f'{{"max_batch": {max_batch}, "event": "ready", "timestamp": "2026-01-01T00:00:00Z"}}'
    step = step_line(1, end_s=1.0, step_ms=100, rows=1, prefill_tokens=8, decode_rows=0)
    assert read_timeline(write_log(tmp_path / "serve.jsonl", [ready, step])).max_batch is None


def test_each_step_is_a_box_from_its_start_to_its_end_at_its_value():
    """Zero between boxes, so an idle gap between two steps shows as a gap."""
    steps = (StepSample(1, 0.0, 500, 2, 96, 0, 0, 0), StepSample(2, 0.75, 250, 3, 40, 2, 0, 0))
    xs, ys = _boxes(steps, [2.0, 3.0])
    assert xs == [0.0, 0.0, 0.5, 0.5, 0.75, 0.75, 1.0, 1.0]
    assert ys == [0.0, 2.0, 2.0, 0.0, 0.0, 3.0, 3.0, 0.0]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("step_ms", float("nan"), "nan"),
        ("step_ms", float("inf"), "inf"),
        ("rows", -2, "-2"),
        ("cached_tokens", -0.5, "-0.5"),
        ("rows", 10**400, "10000000000000000..."),  # valid JSON, beyond any float
        # Finite, yet matplotlib's ticks overflowed on it (a traceback, no picture).
        ("step_ms", 1.7e308, "1.7e+308"),
        ("rows", 2**53 + 2, repr(2**53 + 2)),
    ],
    ids=["nan", "infinity", "negative-int", "negative-float", "beyond-float", "near-max", "past-2**53"],
)
def test_a_step_event_whose_numbers_cannot_be_drawn_is_an_error_naming_its_line(
    tmp_path, field, value, shown
):
    good = step_line(1, end_s=1.0, step_ms=100, rows=2, prefill_tokens=8, decode_rows=0)
    bad = json.loads(step_line(2, end_s=1.5, step_ms=100, rows=2, prefill_tokens=0, decode_rows=2))
    log = write_log(tmp_path / "serve.jsonl", ["not json", good, json.dumps({**bad, field: value})])
    with pytest.raises(CadenceError) as error:
        read_timeline(log)
    assert str(error.value) == (
        f"{log}:3: a step event's {field} is {shown}, not a number in [0, 2**53]"
    )


@pytest.mark.parametrize("huge", [2**53, 2.0**53], ids=["int", "float"])
def test_token_counts_whose_stacked_sum_is_past_what_is_drawn_are_an_error_naming_the_line(
    tmp_path, huge
):
    """Each is drawable alone; the drawing stacks them (it raised OverflowError for ints)."""
    line = step_line(1, end_s=1.0, step_ms=10, rows=1, prefill_tokens=huge, decode_rows=huge)
    log = write_log(tmp_path / "serve.jsonl", [line])
    with pytest.raises(CadenceError) as error:
        read_timeline(log)
    assert str(error.value) == (
        f"{log}:1: a step event's prefill_tokens + decode_rows is past 2**53"
    )


@pytest.mark.parametrize("name", ["", ".", "timeline", ".png", "timeline.unknownext"])
def test_the_output_must_be_an_image_file_it_is_written_as(tmp_path, capsys, name):
    """matplotlib adds ".png" to a name without a suffix, and refuses other suffixes."""
    log = write_log(tmp_path / "serve.jsonl", [step_line(1, 1.0, 10, 1, 5, 0)])
    with pytest.raises(SystemExit) as exit:
        _parser().parse_args(["trace", "timeline", str(log), "-o", name])
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"cadence trace timeline: error: argument -o/--output: {name!r}")


def test_any_case_of_a_known_suffix_is_written_under_the_name_given(tmp_path, capsys):
    log = write_log(tmp_path / "serve.jsonl", [step_line(1, 1.0, 10, 1, 5, 0)])
    args = _parser().parse_args(["trace", "timeline", str(log), "-o", str(tmp_path / "t.SVG")])
    assert args.run(args) == 0
    assert capsys.readouterr().out == f"{tmp_path / 't.SVG'}: 1 steps\n"
    assert (tmp_path / "t.SVG").read_bytes().lstrip().startswith(b"<?xml")


def test_a_step_logged_after_one_that_started_later_still_starts_at_or_after_zero(tmp_path):
    """Two models in one process log their steps into one log, each when it ends: the
    first line need not be the first step to start."""
    log = write_log(
        tmp_path / "serve.jsonl",
        [
            step_line(1, end_s=10.5, step_ms=100, rows=1, prefill_tokens=8, decode_rows=0),
            step_line(1, end_s=10.6, step_ms=400, rows=1, prefill_tokens=16, decode_rows=0),
        ],
    )
    first, second = read_timeline(log).steps
    assert second.start_s == 0.0 and first.start_s == pytest.approx(0.2, abs=1e-3)


def test_the_title_sums_the_tokens_computed_the_cached_tokens_and_the_preemptions(tmp_path):
    import matplotlib

    steps = (
        StepSample(1, 0.0, 500, 2, 96, 0, cached_tokens=32, preempted=0),
        StepSample(2, 0.5, 250, 3, 40, 2, cached_tokens=16, preempted=2),
        StepSample(3, 0.75, 250, 3, 0, 3, cached_tokens=0, preempted=0),
    )
    output = tmp_path / "timeline.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, not paths
        draw(Timeline(steps), output)
    # Summed over the steps: a step's cached tokens and its preempted rows count each.
    title = "3 steps, 141 tokens computed, 48 prompt tokens from the prefix cache, 2 preemptions"
    assert title in output.read_text()


def test_a_long_log_is_read_in_memory_for_its_steps_not_its_lines(tmp_path):
    """A long-running server's log is mostly request events: they are skipped as read."""
    request = json.dumps({"request_id": "r" * 32, "event": "finished", "text_chars": 100, "pad": "x" * 300})
    lines = [request] * 30_000 + [step_line(1, end_s=1.0, step_ms=50, rows=1, prefill_tokens=0, decode_rows=1)]
    log = write_log(tmp_path / "long.jsonl", lines)  # 12 MB
    tracemalloc.start()
    try:
        timeline = read_timeline(log)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(timeline.steps) == 1
    assert peak < 2 << 20  # every line kept: 30 MB


def test_a_line_longer_than_any_step_event_is_read_in_pieces_and_skipped(tmp_path, monkeypatch):
    """A log of one endless line was read whole into memory (/dev/zero took it all)."""
    monkeypatch.setattr(timeline, "MAX_LINE_CHARS", 512)  # a step line is ~250
    step = step_line(1, end_s=1.0, step_ms=100, rows=1, prefill_tokens=8, decode_rows=0)
    log = write_log(tmp_path / "serve.jsonl", ["x" * 1000, step])
    assert [s.step for s in read_timeline(log).steps] == [1]
