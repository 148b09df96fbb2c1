"""The soak (`cadence bench soak`), short: rude and faulty clients, then zero leaks."""

from runtime.kv.blocks import BlockPool

from actors import soak

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
