"""The soak (`cadence bench soak`), short: rude and faulty clients, then zero leaks."""

import random

from runtime.kv.blocks import BlockPool

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
