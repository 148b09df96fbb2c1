"""structlog setup for the CLI. The library never calls this: an embedding program
configures structlog (or not) itself.

Lifecycle events, each with `request_id`: admitted, first_token (ttft_ms),
finished (reason, prompt_tokens, completion_tokens, ttft_ms, e2e_ms), aborted,
rejected, failed; per engine step at debug level: step (rows, prefill_tokens,
decode_rows, step_ms). Prompt text is never logged.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(
    log_format: str = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """ISO UTC timestamps, contextvars merged, console or JSON lines, to stderr by default."""
    stream = stream or sys.stderr
    renderers: list[structlog.typing.Processor]
    if log_format == "json":
        renderers = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    elif log_format == "console":  # renders exc_info itself
        renderers = [structlog.dev.ConsoleRenderer(colors=stream.isatty())]
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
