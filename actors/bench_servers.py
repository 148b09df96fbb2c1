"""The servers `cadence bench serve` starts and reads: each in a subprocess of its own.

    with cadence_server(checkpoint, max_batch=16, extra_args=[]) as target: ...
    with mlx_lm_server(checkpoint, max_batch=16) as target: ...   # the peer

A server counts as ready when cadence logs its `ready` event (which names its URL and
model), or when mlx_lm.server answers /v1/models; one that exits first ends the bench
with its last lines of stderr.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from actors.loadgen import Target, one_line

READY_TIMEOUT_S = 600.0  # loading a large checkpoint from a cold disk


@contextlib.contextmanager
def cadence_server(
    checkpoint: Path, max_batch: int, extra_args: Sequence[str]
) -> Iterator[Target]:
    """`cadence serve` on a free loopback port, with `extra_args` (`--cadence-args`)."""
    serve = ["serve", "--model", str(checkpoint), "--port", "0", "--max-batch", str(max_batch)]
    # Last, so they win over the user's: readiness is read from the JSON `ready` event,
    # and `--log-level warning` among extra_args waited 10 minutes for it.
    logs = ["--log-format", "json", "--log-level", "info"]
    command = [sys.executable, "-m", "actors.cli", *serve, *extra_args, *logs]
    with _running("cadence serve", command) as (server, lines, reader):
        ready = _wait(server, lines, reader, lambda: _ready_event(lines))
        yield Target(ready["url"], ready["model"])


@contextlib.contextmanager
def mlx_lm_server(checkpoint: Path, max_batch: int) -> Iterator[Target]:
    """`mlx_lm.server` on a free loopback port, configured as `mlx_lm_args` says."""
    # `import runtime` first puts the same optimized BLAS under mlx for the peer.
    launch = (
        "import runtime, sys; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
    )
    port = _free_port()
    command = [sys.executable, "-c", launch, *mlx_lm_args(checkpoint, port, max_batch)]
    url = f"http://127.0.0.1:{port}"
    with _running("mlx_lm.server", command) as (server, lines, reader):
        _wait(server, lines, reader, lambda: _answers(url))
        yield Target(url, str(checkpoint))


def mlx_lm_args(checkpoint: Path, port: int, max_batch: int) -> list[str]:
    """The peer's command line: as many prompts and decoding streams at once as ours."""
    batch = str(max_batch)
    return [
        *("--model", str(checkpoint), "--port", str(port), "--log-level", "WARNING"),
        *("--decode-concurrency", batch, "--prompt-concurrency", batch),
    ]


def has_mlx_lm() -> bool:
    """Installed, found without importing it: cadence itself never imports mlx-lm."""
    return importlib.util.find_spec("mlx_lm") is not None


@contextlib.contextmanager
def _running(
    name: str, command: list[str]
) -> Iterator[tuple[subprocess.Popen[str], deque[str], threading.Thread]]:
    """The server in a subprocess, its stderr read on a thread (a full pipe would stall it)."""
    print(f"starting {name}", file=sys.stderr)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: deque[str] = deque(maxlen=200)
    assert server.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        yield server, lines, reader
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait(server: subprocess.Popen[str], lines: deque[str], reader: threading.Thread, ready):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if (found := ready()) is not None:
            return found
        if server.poll() is not None:
            reader.join(timeout=5)  # its last lines may still be in the pipe
            tail = "".join(list(lines)[-10:])
            raise SystemExit(f"the server exited with {server.returncode}:\n{tail}")
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready within {READY_TIMEOUT_S:g} s")


def _ready_event(lines: deque[str]) -> dict | None:
    for line in list(lines):
        with contextlib.suppress(ValueError):
            # Any JSON may reach stderr (a warning printed as a bare list or number).
            if isinstance(event := json.loads(line), dict) and event.get("event") == "ready":
                return event
    return None


def _answers(url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
            return True
    except OSError:
        return None


def models_url(url: str) -> str:
    return f"{url.rstrip('/').removesuffix('/v1')}/v1/models"


def first_model(url: str, api_key: str | None) -> str:
    """The first model id the server lists; ValueError if its answer holds none."""
    request = urllib.request.Request(models_url(url))
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    with contextlib.suppress(ValueError, LookupError, TypeError):  # not OpenAI's shape
        model = json.loads(body)["data"][0]["id"]
        if isinstance(model, str) and model:
            return model
    answer = one_line(body) or "an empty body"
    raise ValueError(f"did not list a model (pass --model); it answered: {answer}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
