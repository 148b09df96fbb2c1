"""Prometheus metrics under vLLM's names and meanings, with `cadence:` for `vllm:`.

A dashboard written for vLLM works after renaming the prefix. Each served model
has its own `CollectorRegistry` (one process may serve several, and tests start
many servers), exposed by the HTTP app's /metrics.

Two kinds of source:
- events, recorded as they happen by the actors that see them: the streamer
  (first token, each token, finish) and the scheduler actor (queued, scheduled);
- state the scheduling policy already keeps (running and waiting requests, KV
  usage, prefix-cache lookups, preemptions), read at scrape time by a collector.
  Reading it then needs no hook in the hot loop and cannot drift from the policy;
  it is safe because scrapes run on the Trio thread that owns the policy.
"""

from __future__ import annotations

from collections.abc import Iterator

from runtime.scheduler import FcfsScheduler

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# vLLM's buckets (v1 loggers), so histogram quantiles compare bucket for bucket.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# OpenAI's, as vLLM's `finished_reason` label, and vLLM's for requests that end unfinished
FINISHED_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    """One model's metrics; the actors call the `on_*` methods (times in seconds)."""

    def __init__(self, model_name: str, policy: FcfsScheduler | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, labels, registry=self.registry, buckets=buckets)
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram(
            "cadence:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.inter_token = histogram(
            "cadence:inter_token_latency_seconds",
            "Time between a request's consecutive tokens.",
            INTER_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "cadence:e2e_request_latency_seconds",
            "Arrival to the last token, for finished requests.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "cadence:request_queue_time_seconds",
            "Time in the scheduler's waiting queue before first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("cadence:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("cadence:generation_tokens", "Tokens generated.")
        success = Counter(
            "cadence:request_success",
            "Requests ended, by finish reason (abort: the client left or the service "
            "stopped; error: the request failed).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISHED_REASONS:  # shown at 0 before the first finish
            success.labels(model_name, reason)
        self.success = success
        self.model_name = model_name
        self._queued_at: dict[str, float] = {}
        if policy is not None:
            self.registry.register(_PolicyCollector(model_name, policy))

    def on_first_token(self, num_prompt_tokens: int, ttft: float) -> None:
        # Counted when the prompt's prefill is done, as vLLM does.
        self.prompt_tokens.inc(num_prompt_tokens)
        self.ttft.observe(ttft)
        self.generation_tokens.inc()

    def on_next_token(self, since_last: float) -> None:
        self.generation_tokens.inc()
        self.inter_token.observe(since_last)

    def on_aborted(self) -> None:
        self.success.labels(self.model_name, "abort").inc()

    def on_failed(self) -> None:
        self.success.labels(self.model_name, "error").inc()

    def on_finished(self, finish_reason: str, e2e: float) -> None:
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e)

    def on_queued(self, request_id: str, now: float) -> None:
        self._queued_at[request_id] = now

    def on_dequeued(self, request_id: str, now: float, *, is_scheduled: bool) -> None:
        """Left the waiting queue: scheduled (observed once), rejected or aborted."""
        queued_at = self._queued_at.pop(request_id, None)
        if queued_at is not None and is_scheduled:
            self.queue_time.observe(now - queued_at)


class _PolicyCollector:
    """The policy's state at scrape time."""

    def __init__(self, model_name: str, policy: FcfsScheduler):
        self.model_name = model_name
        self.policy = policy

    def collect(self) -> Iterator[Metric]:
        policy, pool, labels = self.policy, self.policy.pool, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("cadence:num_requests_running", "Requests in the batch.", len(policy.running))
        yield gauge(
            "cadence:num_requests_waiting",
            "Requests in the scheduler's waiting queue (queued or preempted).",
            policy.num_waiting,
        )
        yield gauge(
            "cadence:kv_cache_usage_perc",
            "Fraction of KV blocks held by running requests (0 to 1).",
            pool.num_used_blocks / pool.num_blocks,
        )
        # vLLM's meanings: every prompt token is a query; hits are the tokens of the full
        # blocks found (the pool counts blocks).
        yield counter(
            "cadence:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            pool.num_query_tokens,
        )
        yield counter(
            "cadence:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            pool.num_hit_blocks * pool.block_size,
        )
        yield counter(
            "cadence:num_preemptions",
            "Requests preempted (requeued by recompute) because the KV pool was full.",
            policy.num_preemptions,
        )
