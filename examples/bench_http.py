"""What the actors, channels and SSE cost: single-client decode tok/s through HTTP
beside the Engine's own B=1 figure, on the same checkpoint, in the same run.

    python examples/bench_http.py [--model PATH] [--new-tokens 64] [--prompt-tokens 128]

Without --model it uses bench_engine.py's ~200M-param fp32 Llama-shaped checkpoint
(built once under .bench/). The Engine arm is bench_engine.py's B=1 measurement
(submit/collect with one step of lookahead, decode only). The HTTP arm starts
`cadence serve` in a subprocess (same max batch and context) and streams
completions with the official `openai` client; decode tok/s counts from the first
streamed chunk to the last. The arms alternate, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import runtime  # noqa: F401  (loads the fast BLAS before mlx)
from runtime.checkpoint import load_model
from runtime.engine import Engine

import openai
from bench_engine import bench_checkpoint, ours, prompts_for


def start_server(
    path: Path, max_context: int, extra: list[str] | None = None
) -> tuple[subprocess.Popen, str, str]:
    serve = ["serve", "--model", str(path), "--port", "0", "--log-format", "json"]
    limits = ["--max-batch", "1", "--max-context", str(max_context)]
    command = [sys.executable, "-m", "actors.cli", *serve, *limits, *(extra or [])]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    for line in server.stderr:
        event = json.loads(line)
        if event["event"] == "ready":
            # Keep reading its log so the pipe never fills and stalls the server.
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, event["url"], event["model"]
    raise RuntimeError("the server exited before it was ready")


def http_b1(client: openai.OpenAI, model: str, prompt: list[int], new_tokens: int) -> float:
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=new_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first = last = None
    usage = None
    for chunk in stream:
        if chunk.choices:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            usage = chunk.usage
    assert first is not None and last is not None and usage is not None
    return (usage.completion_tokens - 1) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="best of N per arm")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    args = parser.parse_args()

    path = args.model or bench_checkpoint(args.cache_dir)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    (prompt,) = prompts_for(1, args.prompt_tokens, vocab)
    max_context = args.prompt_tokens + args.new_tokens + 8  # the same KV size for both arms
    engine = Engine(load_model(path), max_batch=1, max_context=max_context)
    server, url, model = start_server(path, max_context)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ours(engine, [prompt], args.new_tokens)  # warm-up, both arms
        http_b1(client, model, prompt, args.new_tokens)
        engine_runs, http_runs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            engine_runs.append(ours(engine, [prompt], args.new_tokens))
            http_runs.append(http_b1(client, model, prompt, args.new_tokens))
    finally:
        server.terminate()
        server.wait(timeout=60)
    engine_tps, http_tps = max(engine_runs), max(http_runs)
    print(f"checkpoint: {path}")
    print(
        f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, B=1 decode tok/s, "
        f"best of {args.repeats} interleaved runs"
    )
    print(f"Engine (submit/collect):     {engine_tps:8.1f}")
    print(f"HTTP (cadence serve + SSE):  {http_tps:8.1f}   ratio {http_tps / engine_tps:.3f}")


if __name__ == "__main__":
    main()
