"""The soak (`cadence bench soak`), short: rude and faulty clients, then zero leaks."""

import contextlib
import json
import os
import random
from types import SimpleNamespace

from runtime.kv.blocks import BlockPool

import attrs
import h11
import pytest

from actors import soak
from actors.cli import _parser

SHORT = dict(
    num_requests=60, num_warmup=20, concurrency=12, disconnect=0.3, fault=0.1, max_tokens=6
)


async def test_a_short_soak_is_clean_and_exercises_every_kind_of_client(tiny):
    report = await soak.run_soak(soak.SoakConfig(str(tiny), **SHORT, max_rss_growth=1.0))
    assert report.problems == []
    counts = report.counts
    assert counts["healthy:same_text"] > 0 and counts["healthy:other_text"] == 0
    assert counts["fault:error"] > 0  # each faulty row failed alone, as an SSE error event
    for kind in ("before_headers", "mid_prefill", "mid_stream"):
        assert counts[f"{kind}:hung_up"] > 0
    assert sum(n for key, n in counts.items() if key.startswith("leak:")) == 0


async def test_the_soak_reports_a_leak(tiny, monkeypatch):
    monkeypatch.setattr(BlockPool, "release", lambda self, blocks: None)  # blocks never return
    config = soak.SoakConfig(str(tiny), **{**SHORT, "num_requests": 20}, settle_timeout=0.5)
    report = await soak.run_soak(config)
    assert any("KV blocks held" in problem for problem in report.problems)


def soak_cli(tiny, *argv):
    """`cadence bench soak ARGV` on the tiny checkpoint, short; RSS is not this test's concern."""
    quick = ["--model", str(tiny), "--warmup", "0", "--max-rss-growth", "10"]
    return soak.main(_parser().parse_args(["bench", "soak", *quick, *argv]))


def test_a_report_that_cannot_be_written_is_one_line_after_the_figures(tiny, capsys):
    """/dev/full: the path checks pass, then the write fails as on a full disk."""
    assert soak_cli(tiny, "--requests", "2", "--max-tokens", "2", "--json", "/dev/full") == 2
    captured = capsys.readouterr()
    assert "2 requests after 0 to warm up" in captured.out
    (line,) = captured.err.splitlines()
    assert line == "cadence bench soak: /dev/full: No space left on device"


def test_one_token_per_request_leaves_no_point_to_hang_up_mid_stream_but_runs(tiny):
    assert soak_cli(tiny, "--requests", "12", "--max-tokens", "1", "--disconnect", "1") == 0


def test_a_soak_with_problems_exits_1(tiny, monkeypatch):
    monkeypatch.setattr(BlockPool, "release", lambda self, blocks: None)  # blocks never return
    assert soak_cli(tiny, "--requests", "2", "--max-tokens", "2") == 1


def test_the_fault_and_disconnect_fractions_together_leave_no_healthy_client():
    config = soak.SoakConfig(disconnect=0.5, fault=0.5)
    assert "healthy" not in soak._kinds(random.Random(0), config, 200)


QUICK = dict(SHORT, num_requests=12, num_warmup=4, fault=0.0, disconnect=0.0)


async def test_a_faulty_row_that_does_not_fail_is_a_problem(tiny, monkeypatch):
    monkeypatch.setattr(soak, "_fault_hook", contextlib.nullcontext)  # the engine never raises
    report = await soak.run_soak(soak.SoakConfig(str(tiny), **{**QUICK, "fault": 0.5}))
    assert "a faulty row was not reported as an error" in report.problems


async def test_a_wrong_text_during_warm_up_is_a_problem_of_the_report(tiny, monkeypatch):
    load, calls = soak._load, []

    async def warm_up_expects_other_texts(client, prompts, kinds, expected, *rest):
        calls.append(len(kinds))
        if len(calls) == 1:
            expected = [text + "?" for text in expected]
        await load(client, prompts, kinds, expected, *rest)

    monkeypatch.setattr(soak, "_load", warm_up_expects_other_texts)
    report = await soak.run_soak(soak.SoakConfig(str(tiny), **QUICK))
    assert calls == [4, 12]
    assert len(report.problems) == 4 and "not its own text" in report.problems[0]


async def test_rss_and_task_growth_past_warm_up_are_problems(tiny, monkeypatch):
    """Both are read after warm-up's settle and again after the load's."""
    settle, count_tasks, num_settles = soak._settle, soak._num_tasks, []

    async def count_settles(*args):
        await settle(*args)
        num_settles.append(None)

    monkeypatch.setattr(soak, "_settle", count_settles)
    monkeypatch.setattr(soak, "_rss_mb", lambda: 100.0 * (1 + len(num_settles)))
    monkeypatch.setattr(soak, "_num_tasks", lambda: count_tasks() + 1000 * len(num_settles))
    config = soak.SoakConfig(str(tiny), **QUICK, max_rss_growth=0.4)
    problems = (await soak.run_soak(config)).problems
    assert "RSS grew from 200 MB to 300 MB" in problems
    assert "1000 more trio tasks than after warm-up" in problems


async def test_a_server_that_answers_wrongly_after_the_soak_is_a_problem(tiny, monkeypatch):
    stream, leaks_checked = soak._Client.stream, []

    async def wrong_once_leaks_are_counted(self, prompt, *rest):
        outcome = await stream(self, prompt, *rest)
        return attrs.evolve(outcome, text=outcome.text + "?") if leaks_checked else outcome

    check_leaks = soak._check_leaks

    async def check_then_mark(*args):
        await check_leaks(*args)
        leaks_checked.append(True)

    monkeypatch.setattr(soak._Client, "stream", wrong_once_leaks_are_counted)
    monkeypatch.setattr(soak, "_check_leaks", check_then_mark)
    report = await soak.run_soak(soak.SoakConfig(str(tiny), **QUICK))
    assert report.problems == ["the server no longer answers correctly after the soak"]


@pytest.mark.parametrize("before", [None, "7:1"])
def test_the_fault_hook_is_armed_inside_and_restored_after(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("CADENCE_FAULT_TOKEN", raising=False)
    else:
        monkeypatch.setenv("CADENCE_FAULT_TOKEN", before)
    with soak._fault_hook():
        assert os.environ["CADENCE_FAULT_TOKEN"] == f"{soak.FAULT_TOKEN}:{soak.FAULT_AT}"
    assert os.environ.get("CADENCE_FAULT_TOKEN") == before


def test_a_finished_stream_is_judged_by_its_text():
    done = soak._Outcome("text", is_done=True, error=None)
    assert soak._verdict("healthy", done, "text") == "same_text"
    assert soak._verdict("healthy", done, "other") == "other_text"
    assert soak._verdict("mid_stream", attrs.evolve(done, is_done=False), "text") == "hung_up"
    assert soak._verdict("fault", attrs.evolve(done, error="HTTP 500"), "text") == "error"


def test_half_the_prompts_share_a_prefix_for_the_prefix_cache():
    prompts = soak._prompts(random.Random(0), 1000)
    shared = prompts[1][:48]
    assert all(p[:48] == shared for p in prompts[1::2])
    assert not any(p[:48] == shared for p in prompts[::2])


async def test_a_single_leaked_row_or_task_is_a_problem():
    async def engine_stats():
        return SimpleNamespace(num_open=1, num_pending=0, num_used_blocks=0)

    llm = SimpleNamespace(num_active=0, num_waiting=0, engine_stats=engine_stats)
    report = soak.SoakReport()
    await soak._check_leaks(llm, soak._num_tasks() - 1, report)
    assert report.problems == [
        "1 engine rows open after the soak",
        "1 more trio tasks than after warm-up",
    ]


class _Replies:
    """A stream that hands over `data` in one piece, then the end of the connection."""

    def __init__(self, data):
        self.data = [data]

    async def receive_some(self, max_bytes):
        return self.data.pop() if self.data else b""


def sse_response(status, *texts):
    frames = b"".join(
        b"data: %s\n\n" % json.dumps({"choices": [{"text": t}]}).encode() for t in texts
    )
    body = frames + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body))
    return head + body


async def read_events(response, kind, hang_up_after=0):
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="POST", target="/", headers=[("Host", "t")]))
    connection.send(h11.EndOfMessage())
    return await soak._read_events(_Replies(response), connection, kind, hang_up_after)


async def test_a_client_hangs_up_after_its_chunk_and_any_non_200_is_an_error():
    whole = await read_events(sse_response(200, "a", "b", "c"), "healthy")
    assert (whole.text, whole.is_done, whole.error) == ("abc", True, None)
    cut = await read_events(sse_response(200, "a", "b", "c"), "mid_stream", 2)
    assert (cut.text, cut.is_done, cut.error) == ("ab", False, None)
    refused = await read_events(sse_response(400), "healthy")
    assert refused.error == "HTTP 400"
