"""`cadence serve` and `cadence generate`.

Generated text goes to stdout, logs to stderr. A bad argument, checkpoint or
request ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.cpu_weights import CPU_QUANTIZE_CHOICES, DEFAULT_CPU_QUANTIZE
from runtime.errors import CadenceError
from runtime.files import shortened
from runtime.kv.budget import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, parse_kv_budget
from runtime.models import FAMILIES
from runtime.scheduler import DEFAULT_PREFILL_CHUNK

import structlog
import trio

from actors import arg_types, bench, timeline
from actors.choices import DEFAULT_MAX_N
from actors.cors import CorsPolicy, parse_origins
from actors.http_access import LOOPBACK_HOSTS, hostname, is_loopback
from actors.http_app import ServerState, create_app
from actors.http_server import serve_http
from actors.mlx_thread import exit_now_if_busy
from actors.service import open_llm
from actors.tracing import LEVELS, configure_logging
from kernels.blas import active_blas

log = structlog.get_logger("cadence")

HTTP_GRACE_MARGIN_S = 5.0
MAX_API_KEY_FILE_BYTES = 1 << 20  # keys, one a line: a key file is never this big


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cadence", description="An LLM inference serving runtime for MLX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(serve)
    serve.add_argument(  # "" bound every interface
        "--host", type=arg_types.host, default="127.0.0.1", help="127.0.0.1 unless given"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' (repeatable; also CADENCE_API_KEY)",
    )
    serve.add_argument(
        "--api-key-file", type=Path, default=None, help="a file of API keys, one a line"
    )
    serve.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        help="let browser pages from this origin call the API (repeatable; '*' for any); "
        "CORS is off without it",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="on loopback, also answer requests for this host name (repeatable); "
        "by default only localhost, 127.0.0.1 and ::1",
    )
    serve.add_argument("--port", type=arg_types.port, default=8000, help="0: any free port")
    serve.add_argument(
        "--max-batch", type=arg_types.positive_int, default=16, help="rows decoded together"
    )
    serve.add_argument(
        "--max-waiting",
        type=arg_types.positive_int,
        default=64,
        help="queued requests before new ones get 503",
    )
    serve.add_argument(
        "--max-context",
        type=arg_types.positive_int,
        default=None,
        help="tokens per sequence (default: the model's)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=arg_types.non_negative_float,
        default=30.0,
        help="seconds in-flight requests get after SIGINT/SIGTERM",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=arg_types.positive_int,
        default=4 << 20,
        help="request bodies above this many bytes get a JSON 413 (default: 4 MiB)",
    )
    serve.add_argument(
        "--max-http-requests",
        type=arg_types.positive_int,
        default=None,
        help="HTTP requests in flight (body being read, queued, generating, answer being "
        "sent) before new ones get 503 without their body read "
        "(default: 2 x (--max-batch + --max-waiting))",
    )
    serve.add_argument(
        "--max-n",
        type=arg_types.positive_int,
        default=None,
        help=f"most choices ('n') one request may ask for; each counts as a request "
        f"(default: {DEFAULT_MAX_N}, or --max-waiting if that is lower)",
    )
    serve.add_argument(
        "--kv-budget",
        type=_kv_budget,
        default=None,
        help="KV pool size: bytes (8GiB, 512MB) or a fraction of free memory (0.5); "
        "default: 30%% of free memory, at most what --max-batch rows of --max-context need",
    )
    serve.add_argument(
        "--block-size",
        type=arg_types.int_in(1, MAX_BLOCK_SIZE),
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=arg_types.positive_int,
        default=DEFAULT_PREFILL_CHUNK,
        help="most prompt tokens one request computes in a step beside decoding rows "
        "(alone, a prompt takes 512 a step or this if more, but never past "
        "--max-num-batched-tokens)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=arg_types.positive_int,
        default=None,
        help="most tokens a step computes over all rows, a prompt alone included: decoding "
        "rows first, prompt chunks fill the rest (default: --max-batch + --prefill-chunk, "
        "and 512 prompt tokens when no row decodes)",
    )
    serve.add_argument(
        "--batch-ladder",
        action="store_true",
        help="time the model's dense layers at 1..--max-batch tokens at start-up and pad "
        "each step to the cheapest size at or above its own (see README, Scheduling)",
    )
    serve.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the step shapes once on dummy prompts before serving, so no request "
        "waits for a kernel compile (default: on a GPU, where mlx compiles each kernel "
        "the first time a step needs it)",
    )
    serve.add_argument(
        "--no-think-split",
        dest="think_split",
        action="store_false",
        help="leave a thinking model's thought (Qwen3's, QwQ's, R1's <think>, Magistral's "
        "[THINK]) in content, tags and all, "
        "not apart as reasoning_content (see README, Tools and reasoning)",
    )
    serve.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="never reuse the K/V of an earlier request's prompt",
    )
    _add_log_args(serve, default_level="info")
    serve.set_defaults(run=_serve)

    generate = commands.add_parser("generate", help="stream one completion to stdout")
    generate.add_argument("prompt")
    _add_model_args(generate)
    generate.add_argument("--max-tokens", type=arg_types.positive_int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1: off")
    generate.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    generate.add_argument("--min-p", type=float, default=0.0, help="0: off")
    generate.add_argument("--seed", type=int, default=None, help="for a repeatable sample")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message")
    _add_log_args(generate, default_level="warning")
    generate.set_defaults(run=_generate)
    bench.add_parser(commands)
    timeline.add_parser(commands)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        type=arg_types.non_empty,  # "" was the current directory
        help=(
            "checkpoint directory, GGUF file or Hugging Face repo id (default: the demo); "
            f"model_type one of: {', '.join(sorted(FAMILIES))}"
        ),
    )
    parser.add_argument("--offline", action="store_true", help="never download")
    parser.add_argument(
        "--keep-dtype",
        action="store_true",
        help="on CPU, keep and compute in the checkpoint's stored dtype (default: the --cpu-quantize policy)",
    )
    parser.add_argument(
        "--cpu-quantize",
        choices=CPU_QUANTIZE_CHOICES,
        default=None,  # unset, so that --keep-dtype can refuse one given beside it
        help="on CPU, a 16/32-bit checkpoint's linear layers: off keeps 16-bit weights "
        "(float32 compute), float32 expands them, 8 or 4 quantizes them at load "
        f"(default: {DEFAULT_CPU_QUANTIZE}; quantized checkpoints stay quantized either way)",
    )


def _add_log_args(parser: argparse.ArgumentParser, default_level: str) -> None:
    parser.add_argument(
        "--log-format",
        choices=("console", "json"),
        default="console",
        help="structured logs on stderr, for a person or one JSON object a line (default: console)",
    )
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default=default_level,
        help=f"debug adds a line per engine step (default: {default_level})",
    )


def _api_keys(args: argparse.Namespace) -> list[str]:
    keys = [*args.api_key]
    if env := os.environ.get("CADENCE_API_KEY"):
        keys.append(env)
    if args.api_key_file is not None:
        file = args.api_key_file
        try:
            # A FIFO hung the start-up, and /dev/zero filled the memory.
            info = file.stat()
            if not stat.S_ISREG(info.st_mode):
                raise CadenceError(f"--api-key-file {file}: not a regular file")
            if info.st_size > MAX_API_KEY_FILE_BYTES:
                raise CadenceError(
                    f"--api-key-file {file}: over {MAX_API_KEY_FILE_BYTES >> 20} MiB, no key file"
                )
            # utf-8-sig: Notepad starts a UTF-8 file with a BOM, which read as part of the
            # first key (or comment) and was refused as not ASCII.
            lines = file.read_text(encoding="utf-8-sig").splitlines()
        except OSError as error:
            raise CadenceError(f"--api-key-file {args.api_key_file}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise CadenceError(f"--api-key-file {args.api_key_file}: not UTF-8 text") from None
        in_file = [k for k in map(str.strip, lines) if k and not k.startswith("#")]
        if not in_file:  # an empty file must not quietly mean "no authentication"
            raise CadenceError(f"--api-key-file {args.api_key_file} holds no keys")
        keys += in_file
    # Printable ASCII: clients send no other header bytes (the OpenAI SDKs refuse to, and
    # what curl sends never matched), so a key like 'clé' locked every client out.
    if any(not key or not key.isascii() or not key.isprintable() or " " in key for key in keys):
        raise CadenceError("API keys must be non-empty printable ASCII with no whitespace")
    return keys


def _kv_budget(text: str) -> int | float:
    try:
        return parse_kv_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _progress(message: str) -> None:
    log.info("loading", step=message)


async def _serve(args: argparse.Namespace) -> None:
    budget = args.max_num_batched_tokens
    if budget is not None and budget < args.max_batch:  # before minutes of loading
        raise CadenceError(
            f"--max-num-batched-tokens {budget} is below --max-batch {args.max_batch}: "
            "every decoding row needs its token"
        )
    if args.max_n is None:  # n choices take n waiting slots at once: never more than exist
        args.max_n = min(DEFAULT_MAX_N, args.max_waiting)
    elif args.max_n > args.max_waiting:
        raise CadenceError(f"--max-n {args.max_n} is above --max-waiting {args.max_waiting}")
    if args.max_http_requests is None:
        args.max_http_requests = default_max_http_requests(args.max_batch, args.max_waiting)
    state = ServerState()
    keys = _api_keys(args)
    if not keys and not is_loopback(args.host):
        log.warning("no_api_key", host=args.host, hint="anyone who can reach it can use it")
    cors = CorsPolicy(parse_origins(args.allowed_origin))
    # On loopback only the machine's own names: a page's name rebound to 127.0.0.1 is refused.
    allowed_hosts = None
    if is_loopback(args.host):
        allowed_hosts = LOOPBACK_HOSTS | {hostname(name) for name in [args.host, *args.allowed_host]}
    app = create_app(
        state,
        max_body_bytes=args.max_body_bytes,
        api_keys=keys,
        cors=cors,
        max_n=args.max_n,
        allowed_hosts=allowed_hosts,
    )
    shutdown = trio.Event()
    http_done = trio.Event()

    async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve_http(
                app,
                args.host,
                args.port,
                shutdown_trigger=shutdown.wait,
                # Longer than the engine's drain: streams it aborts still get to write
                # their error event and [DONE] before the server closes connections.
                graceful_timeout=args.drain_timeout + HTTP_GRACE_MARGIN_S,
                max_requests=args.max_http_requests,
                cors=cors,
                task_status=task_status,
            )
        finally:
            http_done.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, state, shutdown, nursery.cancel_scope)
        urls = await nursery.start(run_http)
        log.info("loading", model=args.model or "demo", url=urls[0], blas=active_blas())
        async with open_llm(
            args.model,
            max_batch=args.max_batch,
            max_waiting=args.max_waiting,
            max_context=args.max_context,
            kv_budget=args.kv_budget,
            block_size=args.block_size,
            prefix_cache=args.prefix_cache,
            prefill_chunk=args.prefill_chunk,
            max_num_batched_tokens=args.max_num_batched_tokens,
            batch_ladder=args.batch_ladder,
            warm_up=args.warm_up,
            offline=args.offline,
            keep_dtype=args.keep_dtype,
            cpu_quantize=args.cpu_quantize or DEFAULT_CPU_QUANTIZE,
            on_progress=_progress,
            drain_timeout=args.drain_timeout,
            think_split=args.think_split,
        ) as llm:
            state.llm = llm
            log.info(
                "ready",
                url=urls[0],
                model=llm.name,
                max_batch=llm.max_batch,
                max_context=llm.max_context,
            )
            await shutdown.wait()
            state.is_draining = True
            log.info("draining", grace_s=args.drain_timeout)
            await llm.drain(args.drain_timeout)  # then what is left is aborted, cleanly
            await http_done.wait()
        log.info("stopped")
        nursery.cancel_scope.cancel()  # the signal watcher


def default_max_http_requests(max_batch: int, max_waiting: int) -> int:
    """Room for every request the engine can hold (running and waiting), so that the
    waiting queue, not this cap, answers an ordinary overload; and as many again for
    requests whose bodies are still arriving or whose answers are still being sent.
    Each holds up to --max-body-bytes while its body is read: this bounds that memory."""
    return 2 * (max_batch + max_waiting)


async def _watch_signals(
    state: ServerState,
    shutdown: trio.Event,
    everything: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None],
) -> None:
    """First SIGINT/SIGTERM drains; a second one (or one while loading) stops at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if shutdown.is_set() or state.llm is None:
                log.warning("stopping now", signal=signal.Signals(signum).name)
                everything.cancel()
                return
            log.info("shutdown requested", signal=signal.Signals(signum).name)
            shutdown.set()


async def _generate(args: argparse.Namespace) -> None:
    log.info("loading", model=args.model or "demo", blas=active_blas())
    async with open_llm(
        args.model,
        max_batch=1,
        max_waiting=1,
        offline=args.offline,
        keep_dtype=args.keep_dtype,
        cpu_quantize=args.cpu_quantize or DEFAULT_CPU_QUANTIZE,
        on_progress=_progress,
    ) as llm:
        sampling = dict(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
        )
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            generation = llm.generate(messages=messages, max_tokens=args.max_tokens, **sampling)
        else:
            generation = llm.generate(args.prompt, max_tokens=args.max_tokens, **sampling)
        async with generation:
            async for delta in generation:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        sys.stdout.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    _replace_closed_streams()
    status = _run(argv)
    exit_now_if_busy(status)  # a load cut short by a signal may still be running
    return status


def _run(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "keep_dtype", False) and args.cpu_quantize is not None:
        # --keep-dtype replaces the policy --cpu-quantize sets: one given beside it was ignored.
        parser.error("--keep-dtype keeps the stored weights; it takes no --cpu-quantize")
    synchronous = args.command in ("bench", "trace")  # they return their exit status
    if synchronous:
        configure_logging("console", "warning")
    else:
        configure_logging(args.log_format, args.log_level)
    try:
        # A bench's bad --model or --checkpoint (soak's open_llm, serve's config.json)
        # raised out of here as a traceback: they get the same one line as serve's.
        if synchronous:
            return int(args.run(args))
        trio.run(args.run, args)
    except BaseException as exc:  # trio wraps errors from nurseries in groups
        if (error := _leaf(exc, CadenceError)) is not None:
            print(f"cadence: error: {error}", file=sys.stderr)
            return 2
        if isinstance(os_error := _leaf(exc, OSError), OSError):  # e.g. the port is taken
            where = f"{shortened(str(os_error.filename))}: " if os_error.filename else ""
            if isinstance(os_error, socket.gaierror) and getattr(args, "host", None):
                where = f"--host {args.host!r}: "  # "Name or service not known" alone named nothing
            print(f"cadence: error: {where}{os_error.strerror or os_error}", file=sys.stderr)
            return 2
        if _leaf(exc, KeyboardInterrupt) is not None:
            return 130
        raise
    return 0


def _replace_closed_streams() -> None:
    """Started with stdout or stderr closed (`>&-`, some launchers), Python has None
    there: logging's isatty() and generate's write raised, so nothing ran. Such output
    goes to /dev/null, as the caller who closed it chose."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115  (for the process's life)


def _leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _leaf(inner, kind)) is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
