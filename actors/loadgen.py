"""A load generator for any OpenAI-compatible server (`cadence bench serve` drives it).

Each request is one greedy streaming completion (chat or text) on its own raw
HTTP/1.1 connection, so nothing but the server stands between two chunks. Load is
closed-loop (`clients` streams at a time, each starting the next request when its
last one ends) or open-loop (Poisson arrivals at `rate` requests a second).

Per request it stamps every chunk that carries text; a run reports output tok/s
over the whole run, time to first token, inter-token latency (the gaps between
consecutive text chunks of a stream, pooled over streams), the worst such gap, and
errors (an HTTP status, an SSE error event, a dropped or timed-out stream), which
are counted, never raised.
"""

from __future__ import annotations

import contextlib
import json
import random
import ssl
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from runtime.tokenizer import Tokenizer

import attrs
import h11
import trio


@attrs.frozen
class Span:
    """A fixed integer or a uniform integer range, from "100" or "100:400"."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_span(text: str) -> Span:
    low, _, high = text.partition(":")
    try:
        span = Span(int(low), int(high or low))
    except ValueError:
        raise ValueError(f"expected N or LOW:HIGH, got {text!r}") from None
    if not 1 <= span.low <= span.high:
        raise ValueError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return span


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between ranks; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = int(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@attrs.frozen
class Workload:
    num_requests: int
    clients: int | None = None  # closed loop: this many streams at a time
    rate: float | None = None  # open loop: Poisson arrivals, requests a second
    prompt_tokens: Span = Span(100, 100)
    max_tokens: Span = Span(64, 64)
    shared_prefix: float = 0.0  # this fraction of every prompt is common to all
    endpoint: str = "chat"  # or "completions"
    ignore_eos: bool = True
    timeout: float = 600.0  # seconds a request may take
    seed: int = 0

    @property
    def label(self) -> str:
        if self.rate:
            return f"{self.rate:g} req/s"
        return "1 client" if self.clients == 1 else f"{self.clients} clients"


@attrs.frozen
class Target:
    url: str  # http(s)://host:port, with or without a trailing /v1
    model: str
    api_key: str | None = None


@attrs.frozen
class Request:
    prompt: str
    max_tokens: int
    num_prompt_tokens: int  # as built; the server's usage count replaces it when sent


@attrs.frozen
class Outcome:
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    start: float  # perf_counter seconds
    end: float
    stamps: tuple[float, ...]  # arrival of each chunk that carried text


@attrs.frozen
class RunResult:
    """One run's figures; seconds throughout, tok/s over the run's wall time."""

    label: str
    num_requests: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]  # message -> count
    seconds: float
    num_prompt_tokens: int
    num_output_tokens: int
    output_tok_s: float
    # None where nothing was timed: no stream carried text (token ids that decode to
    # nothing), or, for the gaps, none carried two pieces of it
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    worst_gap: float | None


def build_requests(workload: Workload, tokenizer: Tokenizer | None) -> list[Request]:
    """Distinct prompts of the drawn lengths (tokens by `tokenizer`, else words).

    Distinct words keep servers from reusing a cached prefix beyond `shared_prefix`.
    """
    rng = random.Random(workload.seed)
    words = _words()
    longest = workload.prompt_tokens.high
    shared = _units(rng, words, longest, tokenizer)
    requests = []
    for _ in range(workload.num_requests):
        length = workload.prompt_tokens.draw(rng)
        num_shared = round(length * workload.shared_prefix)
        units = shared[:num_shared] + _units(rng, words, length - num_shared, tokenizer)
        if tokenizer is None:
            prompt = " ".join(str(u) for u in units)
        else:
            prompt = tokenizer.decode([int(u) for u in units])
        requests.append(Request(prompt, workload.max_tokens.draw(rng), length))
    return requests


def _words() -> list[str]:
    try:
        from pydoc_data.topics import topics  # plain English text, shipped with Python
    except ImportError:  # some distributions strip it
        return [f"w{i}" for i in range(5000)]
    return " ".join(topics.values()).split()


def _units(
    rng: random.Random, words: list[str], count: int, tokenizer: Tokenizer | None
) -> list[Any]:
    """`count` words, or `count` token ids of random words."""
    if tokenizer is None:
        return [rng.choice(words) for _ in range(count)]
    ids: list[int] = []
    while len(ids) < count:
        text = " " + " ".join(rng.choice(words) for _ in range(count - len(ids)))
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:count]


async def run_load(
    target: Target, workload: Workload, requests: Sequence[Request], *, show: bool = True
) -> RunResult:
    """Send `requests` as `workload` says; returns the run's figures."""
    outcomes: list[Outcome] = []
    progress = _Progress(workload.label, len(requests), show)
    rng = random.Random(workload.seed + 1)

    async def one(request: Request) -> None:
        outcome = await stream_request(target, workload, request)
        outcomes.append(outcome)
        progress.update(outcome.error is not None)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        if workload.rate:
            for index, request in enumerate(requests):
                if index:  # a gap between arrivals, none after the last
                    await trio.sleep(rng.expovariate(workload.rate))
                nursery.start_soon(one, request)
        else:
            queue = list(reversed(requests))

            async def client() -> None:
                while queue:
                    await one(queue.pop())

            for _ in range(workload.clients or 1):
                nursery.start_soon(client)
    progress.close()
    return summarize(workload.label, outcomes, start)


def summarize(label: str, outcomes: Sequence[Outcome], start: float) -> RunResult:
    ok = [o for o in outcomes if o.error is None]
    gaps = [b - a for o in ok for a, b in zip(o.stamps, o.stamps[1:], strict=False)]
    ttfts = [o.stamps[0] - o.start for o in ok if o.stamps]
    seconds = max((o.end for o in outcomes), default=start) - start
    num_output = sum(o.num_output_tokens for o in ok)
    return RunResult(
        label=label,
        num_requests=len(outcomes),
        num_ok=len(ok),
        num_errors=len(outcomes) - len(ok),
        errors=dict(Counter(o.error for o in outcomes if o.error is not None)),
        seconds=seconds,
        num_prompt_tokens=sum(o.num_prompt_tokens for o in ok),
        num_output_tokens=num_output,
        output_tok_s=num_output / seconds if seconds > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50) if ttfts else None,
        ttft_p99=percentile(ttfts, 99) if ttfts else None,
        itl_p50=percentile(gaps, 50) if gaps else None,
        itl_p99=percentile(gaps, 99) if gaps else None,
        worst_gap=max(gaps) if gaps else None,
    )


async def stream_request(target: Target, workload: Workload, request: Request) -> Outcome:
    """One streaming request; any failure becomes the outcome's `error`."""
    stream = _Stream(time.perf_counter())
    try:
        with trio.fail_after(workload.timeout):
            await _exchange(target, workload, request, stream)
    except trio.TooSlowError:
        stream.error = f"no answer within {workload.timeout:g} s"
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as error:
        stream.error = f"connection: {error}"
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as error:
        stream.error = f"bad chunk: {error!r}"  # malformed, or nested past Python's limit
    if stream.error is None and not stream.is_done:
        stream.error = "the stream ended without [DONE]"
    num_output = stream.num_output_tokens or len(stream.stamps)
    return Outcome(
        stream.error,
        stream.num_prompt_tokens or request.num_prompt_tokens,
        num_output,
        stream.start,
        time.perf_counter(),
        tuple(stream.stamps),
    )


@attrs.define
class _Stream:
    start: float
    stamps: list[float] = attrs.Factory(list)
    error: str | None = None
    is_done: bool = False
    num_prompt_tokens: int = 0  # from the usage chunk, when the server sends one
    num_output_tokens: int = 0

    def on_event(self, payload: bytes, endpoint: str) -> None:
        """One SSE `data:` payload. Any server may send anything: a chunk not shaped as
        OpenAI's raises ValueError, which the request's outcome counts as a bad chunk."""
        if payload == b"[DONE]":
            self.is_done = True
            return
        chunk = _shaped(json.loads(payload), dict, "chunk")
        if "error" in chunk:
            error = chunk["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if usage := chunk.get("usage"):
            usage = _shaped(usage, dict, "usage")
            self.num_prompt_tokens = _count(usage.get("prompt_tokens"))
            self.num_output_tokens = _count(usage.get("completion_tokens"))
        for choice in _shaped(chunk.get("choices") or [], list, "choices"):
            choice = _shaped(choice, dict, "choice")
            if endpoint == "chat":
                delta = _shaped(choice.get("delta") or {}, dict, "delta")
                # Reasoning and tool-call deltas are output too: stamped by content
                # alone, a reasoning model's first token was the end of its thinking.
                carries_output = any(delta.get(key) for key in _CHAT_OUTPUT_KEYS)
            else:
                carries_output = bool(choice.get("text"))
            if carries_output:
                self.stamps.append(time.perf_counter())


# What a chat delta carries of the reply: text, reasoning (vLLM's and cadence's two names), calls.
_CHAT_OUTPUT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


def _shaped(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{name} is no {kind.__name__}: {one_line(repr(value), 60)}")
    return value


def _count(value: Any) -> int:
    """A usage count: absent is 0, anything but an integer >= 0 a bad chunk."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a usage count of {one_line(repr(value), 60)}")
    return value


def _body(target: Target, workload: Workload, request: Request) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


async def _exchange(target: Target, workload: Workload, request: Request, stream: _Stream) -> None:
    url = urllib.parse.urlsplit(target.url)
    host, is_tls = url.hostname or "127.0.0.1", url.scheme == "https"
    port = url.port or (443 if is_tls else 80)
    base = url.path.rstrip("/").removesuffix("/v1")
    path = (
        f"{base}/v1/chat/completions" if workload.endpoint == "chat" else f"{base}/v1/completions"
    )
    body = json.dumps(_body(target, workload, request)).encode()
    headers = [
        ("Host", url.netloc),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
    ]
    if target.api_key:
        headers.append(("Authorization", f"Bearer {target.api_key}"))
    connection = h11.Connection(h11.CLIENT)
    opened: trio.abc.Stream
    if is_tls:
        opened = await trio.open_ssl_over_tcp_stream(
            host, port, ssl_context=ssl.create_default_context()
        )
    else:
        opened = await trio.open_tcp_stream(host, port)
    async with opened as socket:
        head = connection.send(h11.Request(method="POST", target=path, headers=headers))
        data = connection.send(h11.Data(data=body))
        try:
            await socket.send_all(head + data + connection.send(h11.EndOfMessage()))
        except (OSError, trio.BrokenResourceError) as unsent:
            # A server may answer before it has read the body (a 413) and close: its
            # answer says why, where the broken pipe said nothing.
            with contextlib.suppress(OSError, trio.BrokenResourceError, h11.ProtocolError):
                await _read(socket, connection, workload.endpoint, stream)
            if stream.error is None:
                raise unsent
            return
        await _read(socket, connection, workload.endpoint, stream)


async def _read(
    socket: trio.abc.Stream, connection: h11.Connection, endpoint: str, stream: _Stream
) -> None:
    buffer, status = b"", 200
    while stream.error is None and not stream.is_done:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = await socket.receive_some(65536)
            # An empty read is the connection's end: h11 then says whether that ended
            # the response (a body delimited by the close) or cut it short.
            connection.receive_data(bytes(data))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            buffer += bytes(event.data)
            if status != 200:
                continue
            buffer = buffer.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                for line in frame.split(b"\n"):
                    if line.startswith(b"data:"):
                        stream.on_event(line[5:].strip(), endpoint)
        else:  # the end of the response or of the connection
            break
    if status != 200:
        stream.error = f"HTTP {status}: {_error_message(buffer)}"


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return one_line(str(error["message"] if isinstance(error, dict) else error))
    except (ValueError, KeyError, TypeError):
        return one_line(body)


def one_line(text: str | bytes, limit: int = 200) -> str:
    """A server's answer (an HTML error page, say) as one line of at most `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _Progress:
    """A one-line bar on stderr while a run goes, when stderr is a terminal."""

    def __init__(self, label: str, total: int, show: bool):
        self.label, self.total = label, total
        self.is_shown = show and sys.stderr.isatty()
        self.num_done = self.num_errors = 0
        self._draw()

    def update(self, is_error: bool) -> None:
        self.num_done += 1
        self.num_errors += is_error
        self._draw()

    def close(self) -> None:
        if self.is_shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self.is_shown:
            return
        filled = 30 * self.num_done // max(self.total, 1)
        bar = "#" * filled + "-" * (30 - filled)
        errors = f", {self.num_errors} errors" if self.num_errors else ""
        sys.stderr.write(f"\r{self.label:>14} [{bar}] {self.num_done}/{self.total}{errors}")
        sys.stderr.flush()
