"""`cadence bench soak`: many streaming clients, some rude, some faulty; then count leaks.

The server (the real HTTP front, actors and engine) runs in this process on a
loopback port, so what it holds afterwards can be read directly. Each client posts
a greedy streaming completion of one of a few token-id prompts (half of them share
a prefix, so prefix-cache hits mix in), over its own raw HTTP/1.1 connection:

- most read to `[DONE]`: their text must equal that prompt's text generated alone;
- `--disconnect` of them hang up at a random point: before the response headers,
  after the headers but before any text (mid-prefill), or after a few chunks;
- `--fault` of them carry the fault token, and the engine raises inside the batched
  forward for their row (`CADENCE_FAULT_TOKEN`, see runtime/engine.py): they must end
  with an SSE error event while the rows beside them go on unchanged.

Then: no engine rows, queued steps, KV blocks, waiting slots or trio tasks left
behind; RSS after the load within `--max-rss-growth` of RSS after a warm-up of the
same load (`--warmup` requests: measured, glibc's and MLX's allocators climb for a
few hundred requests before they level off); and the server still answers. It prints the figures and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import h11
import trio

from actors import arg_types
from actors.bench_serve import write_json
from actors.http_app import ServerState, create_app
from actors.http_server import serving_on_loopback
from actors.llm import LLM
from actors.service import open_llm

FAULT_TOKEN = 50  # healthy prompts use ids from 100 up
FAULT_AT = 2  # tokens a faulty row samples before its forward raises


@attrs.frozen
class SoakConfig:
    model: str | None = None  # None: the built-in demo checkpoint
    num_requests: int = 1000
    concurrency: int = 24
    disconnect: float = 0.2
    fault: float = 0.01
    max_tokens: int = 16
    num_warmup: int = 500  # requests before the soak's own, until RSS stops climbing
    max_rss_growth: float = 0.10
    seed: int = 0
    settle_timeout: float = 30.0  # for the last aborts to land before leaks are counted


@attrs.define
class SoakReport:
    counts: Counter[str] = attrs.Factory(Counter)  # "<kind>:<outcome>"
    problems: list[str] = attrs.Factory(list)
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    seconds: float = 0.0

    @property
    def is_clean(self) -> bool:
        return not self.problems


@attrs.frozen
class _Outcome:
    text: str
    is_done: bool  # read to [DONE]
    error: str | None  # an HTTP status or an SSE error event's message


async def run_soak(config: SoakConfig) -> SoakReport:
    rng = random.Random(config.seed)
    report = SoakReport()
    async with _serving(config) as (llm, port):
        client = _Client(port, llm.name, config.max_tokens)
        prompts = _prompts(rng, llm.vocab_size)
        expected = [(await client.stream(p)).text for p in prompts]
        warmup = SoakReport()  # the same load, uncounted: allocators grow to their plateau
        await _load(
            client, prompts, _kinds(rng, config, config.num_warmup), expected, config, rng, warmup
        )
        await _settle(llm, config.settle_timeout)
        report.problems += warmup.problems
        tasks_warm, report.rss_warm_mb = _num_tasks(), _rss_mb()
        started = time.perf_counter()
        await _load(
            client, prompts, _kinds(rng, config, config.num_requests), expected, config, rng, report
        )
        report.seconds = time.perf_counter() - started
        await _settle(llm, config.settle_timeout)
        report.rss_end_mb = _rss_mb()
        await _check_leaks(llm, tasks_warm, report)
        if report.rss_end_mb > report.rss_warm_mb * (1 + config.max_rss_growth):
            report.problems.append(
                f"RSS grew from {report.rss_warm_mb:.0f} MB to {report.rss_end_mb:.0f} MB"
            )
        again = await client.stream(prompts[0])
        if (again.text, again.is_done) != (expected[0], True):
            report.problems.append("the server no longer answers correctly after the soak")
    return report


@contextlib.asynccontextmanager
async def _serving(config: SoakConfig) -> AsyncIterator[tuple[LLM, int]]:
    """The real server on a loopback port, with the fault hook armed for its engine."""
    state = ServerState()
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serving_on_loopback(create_app(state)))
        with _fault_hook():  # armed only while the engine is built: it reads it once
            state.llm = await stack.enter_async_context(
                open_llm(config.model, max_batch=16, max_waiting=64)
            )
        yield state.llm, int(url.rsplit(":", 1)[1])


@contextlib.contextmanager
def _fault_hook() -> Iterator[None]:
    """CADENCE_FAULT_TOKEN, read by the engine built inside."""
    before = os.environ.get("CADENCE_FAULT_TOKEN")
    os.environ["CADENCE_FAULT_TOKEN"] = f"{FAULT_TOKEN}:{FAULT_AT}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CADENCE_FAULT_TOKEN", None)
        else:
            os.environ["CADENCE_FAULT_TOKEN"] = before


def _prompts(rng: random.Random, vocab_size: int) -> list[list[int]]:
    """Twelve prompts of 8-160 tokens; half start with one shared 48-token prefix."""
    top = min(vocab_size, 32_000)  # ids every tokenizer of this vocabulary can decode
    shared = [rng.randrange(100, top) for _ in range(48)]
    prompts = []
    for i in range(12):
        own = [rng.randrange(100, top) for _ in range(rng.randrange(8, 112))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _kinds(rng: random.Random, config: SoakConfig, num_requests: int) -> list[str]:
    kinds = []
    for _ in range(num_requests):
        draw = rng.random()
        if draw < config.fault:
            kinds.append("fault")
        elif draw < config.fault + config.disconnect:
            kinds.append(rng.choice(("before_headers", "mid_prefill", "mid_stream")))
        else:
            kinds.append("healthy")
    return kinds


async def _load(
    client: _Client,
    prompts: list[list[int]],
    kinds: list[str],
    expected: list[str],
    config: SoakConfig,
    rng: random.Random,
    report: SoakReport,
) -> None:
    limiter = trio.CapacityLimiter(config.concurrency)

    async def one(kind: str, which: int, hang_up_after: int) -> None:
        prompt = prompts[which] + ([FAULT_TOKEN] if kind == "fault" else [])
        async with limiter:
            outcome = await client.stream(prompt, kind, hang_up_after)
        report.counts[f"{kind}:{_verdict(kind, outcome, expected[which])}"] += 1
        if kind == "healthy" and outcome.text != expected[which]:
            report.problems.append(f"a healthy request got {outcome.text!r}, not its own text")
        if kind == "fault" and outcome.error is None:
            report.problems.append("a faulty row was not reported as an error")

    # Mid-stream hang-ups come before the last chunk, where there is more than one.
    last_hang_up = max(1, config.max_tokens - 1)
    async with trio.open_nursery() as nursery:
        for kind in kinds:
            which, hang_up_after = rng.randrange(len(prompts)), rng.randint(1, last_hang_up)
            nursery.start_soon(one, kind, which, hang_up_after)


def _verdict(kind: str, outcome: _Outcome, expected: str) -> str:
    if outcome.error is not None:
        return "error"
    if not outcome.is_done:
        return "hung_up"
    return "same_text" if outcome.text == expected else "other_text"


@attrs.frozen
class _Client:
    port: int
    model: str
    max_tokens: int

    async def stream(
        self, prompt: list[int], kind: str = "healthy", hang_up_after: int = 0
    ) -> _Outcome:
        """One greedy streaming completion on its own connection, hanging up as `kind` says."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        head = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", "127.0.0.1"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Connection", "close"),
            ],
        )
        connection = h11.Connection(h11.CLIENT)
        async with await trio.open_tcp_stream("127.0.0.1", self.port) as stream:
            request = connection.send(head) + connection.send(h11.Data(data=body))
            await stream.send_all(request + connection.send(h11.EndOfMessage()))
            if kind == "before_headers":
                return _Outcome("", False, None)
            return await _read_events(stream, connection, kind, hang_up_after)


async def _read_events(
    stream: trio.SocketStream, connection: h11.Connection, kind: str, hang_up_after: int
) -> _Outcome:
    text, num_chunks, buffer = "", 0, b""
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            if not (data := await stream.receive_some(65536)):
                return _Outcome(text, False, "the server closed the connection")
            connection.receive_data(data)
        elif isinstance(event, h11.Response):
            if event.status_code != 200:
                return _Outcome(text, False, f"HTTP {event.status_code}")
            if kind == "mid_prefill":
                return _Outcome(text, False, None)
        elif isinstance(event, h11.Data):
            buffer += bytes(event.data)
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                payload = frame.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    return _Outcome(text, True, None)
                chunk = json.loads(payload)
                if "error" in chunk:
                    return _Outcome(text, False, chunk["error"]["message"])
                text += chunk["choices"][0]["text"]
                num_chunks += 1
                if kind == "mid_stream" and num_chunks >= hang_up_after:
                    return _Outcome(text, False, None)
        else:  # the end of the response or of the connection, without [DONE]
            return _Outcome(text, False, "the stream ended without [DONE]")


async def _settle(llm: LLM, timeout: float) -> None:
    """Wait until every request has left the service (aborts take a step to land)."""
    with trio.move_on_after(timeout):
        while llm.num_active or (await llm.engine_stats()).num_open:
            await trio.sleep(0.01)
    await trio.sleep(0.2)  # connection tasks unwind after their last byte


async def _check_leaks(llm: LLM, tasks_warm: int, report: SoakReport) -> None:
    stats = await llm.engine_stats()
    leaks = {
        "requests still active": llm.num_active,
        "engine rows open": stats.num_open,
        "engine steps queued": stats.num_pending,
        "KV blocks held": stats.num_used_blocks,
        "waiting slots held": llm.num_waiting,
    }
    for what, count in leaks.items():
        report.counts[f"leak:{what}"] = count
        if count:
            report.problems.append(f"{count} {what} after the soak")
    num_tasks = _num_tasks()
    report.counts["leak:trio tasks"] = max(0, num_tasks - tasks_warm)
    if num_tasks > tasks_warm:
        report.problems.append(f"{num_tasks - tasks_warm} more trio tasks than after warm-up")


def _num_tasks() -> int:
    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

    return count(trio.lowlevel.current_root_task())  # type: ignore[arg-type]


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- the command ----------------------------------------------------------------------


def add_parser(which: argparse._SubParsersAction) -> None:
    soak = which.add_parser("soak", help="rude and faulty clients against the server; count leaks")
    soak.add_argument("--model", default=None, help="a checkpoint directory (default: the demo)")
    soak.add_argument("--requests", type=arg_types.positive_int, default=1000)
    soak.add_argument("--concurrency", type=arg_types.positive_int, default=24)
    soak.add_argument(
        "--disconnect", type=arg_types.fraction, default=0.2, help="fraction that hang up"
    )
    soak.add_argument(
        "--fault", type=arg_types.fraction, default=0.01, help="fraction with a faulty row"
    )
    soak.add_argument("--max-tokens", type=arg_types.positive_int, default=16)
    soak.add_argument(
        "--warmup",
        type=arg_types.non_negative_int,
        default=500,
        help="requests before RSS is first read",
    )
    soak.add_argument("--max-rss-growth", type=arg_types.non_negative_float, default=0.10)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", type=arg_types.output_file, default=None, help="also write the report here")
    soak.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    config = SoakConfig(
        args.model,
        args.requests,
        args.concurrency,
        args.disconnect,
        args.fault,
        args.max_tokens,
        num_warmup=args.warmup,
        max_rss_growth=args.max_rss_growth,
        seed=args.seed,
    )
    report = trio.run(run_soak, config)
    print(
        f"{config.num_requests} requests after {config.num_warmup} to warm up, "
        f"{config.concurrency} at a time, {report.seconds:.1f} s"
    )
    for key, count in sorted(report.counts.items()):
        print(f"  {key:<32} {count}")
    print(
        f"  RSS after warm-up / after load   {report.rss_warm_mb:.0f} MB / {report.rss_end_mb:.0f} MB"
    )
    for problem in report.problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print("clean" if report.is_clean else f"{len(report.problems)} problems")
    as_json = attrs.asdict(report)
    if args.json is not None and not write_json("cadence bench soak", args.json, as_json):
        return 2
    return 0 if report.is_clean else 1
