"""structlog setup for the CLI. The library never calls this: an embedding program
configures structlog (or not) itself.

Lifecycle events, each with `request_id`: admitted, first_token (ttft_ms),
finished (reason, prompt_tokens, completion_tokens, ttft_ms, e2e_ms), aborted,
rejected, failed; per engine step at debug level: step (step, rows, tokens,
prefill_rows, prefill_tokens, decode_rows, cached_tokens: prompt tokens the step's
new rows took from the prefix cache, preempted: rows requeued by recompute while
planning it, free_blocks, prefix_hit_rate, step_ms). step_ms runs from when the step
could start (submitted, or for a queued step, when the one before it was collected)
to when its tokens were read, and the line's timestamp is taken just after that, so
a step spans [timestamp - step_ms, timestamp]. Prompt text is never logged.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
import structlog.tracebacks

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(
    log_format: str = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """ISO UTC timestamps, contextvars merged, console or JSON lines, to stderr by default."""
    stream = stream or sys.stderr
    renderers: list[structlog.typing.Processor]
    # Tracebacks without their frames' locals: structlog's defaults print them, and a
    # request's locals hold its prompt (a failed prepare printed the messages), nested
    # values a line per level (one deep tool call: ~100,000 lines).
    if log_format == "json":
        tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        renderers = [
            structlog.processors.ExceptionRenderer(tracebacks),
            structlog.processors.JSONRenderer(),
        ]
    elif log_format == "console":  # renders exc_info itself
        renderers = [
            structlog.dev.ConsoleRenderer(
                colors=stream.isatty(), exception_formatter=structlog.dev.plain_traceback
            )
        ]
    else:
        raise ValueError(f"unknown log format {log_format!r} (console or json)")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
