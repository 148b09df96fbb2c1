"""`cadence serve` beside `mlx_lm.server`: concurrent streaming chat clients, same checkpoint.

    python examples/bench_serving.py [--clients 1 4 16] [--new-tokens 64]

Each server runs alone in a subprocess (mlx-lm's with the same OpenBLAS loaded
first, so both get the fast BLAS), on bench_engine.py's ~200M fp32 checkpoint with
its vocabulary cut to the demo tokenizer's 2048 tokens, so every token is text.
For each client count, that many `openai` clients stream one greedy chat
completion each, with distinct ~100-word prompts, at once. Printed per server:
output tok/s over the whole burst, TTFT p50/p99, and the worst gap between two
chunks of one stream; then the ratio cadence / mlx-lm. mlx-lm runs with
`--decode-concurrency` equal to cadence's `--max-batch`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from pydoc_data.topics import topics

import openai
from bench_engine import bench_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def cadence_command(path: Path, port: int, batch: int, extra: list[str]) -> list[str]:
    args = ["serve", "--model", str(path), "--port", str(port), "--max-batch", str(batch)]
    return [sys.executable, "-m", "actors.cli", *args, "--log-level", "warning", *extra]


def mlx_lm_command(path: Path, port: int, batch: int) -> list[str]:
    # `import runtime` first puts the same OpenBLAS under mlx for the peer.
    launch = "import runtime, sys; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
    args = ["--model", str(path), "--port", str(port), "--decode-concurrency", str(batch)]
    return [sys.executable, "-c", launch, *args, "--log-level", "WARNING"]


def wait_ready(port: int, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def prompts(count: int, seed: int, words: int = 100) -> list[str]:
    vocabulary = " ".join(topics.values()).split()
    rng = random.Random(seed)  # distinct prompts: no server can reuse a cached prefix
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def stream_one(client: openai.OpenAI, model: str, prompt: str, new_tokens: int, out: dict) -> None:
    start = time.perf_counter()
    stamps = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=new_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    out["ttft"] = stamps[0] - start
    out["tokens"] = tokens or len(stamps)
    out["gap"] = max((b - a for a, b in zip(stamps, stamps[1:], strict=False)), default=0.0)
    out["end"] = stamps[-1]


def burst(port: int, model: str, clients: int, new_tokens: int, seed: int) -> dict[str, float]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    results = [{} for _ in range(clients)]
    threads = [
        threading.Thread(target=stream_one, args=(client, model, p, new_tokens, r))
        for p, r in zip(prompts(clients, seed), results, strict=True)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = max(r["end"] for r in results) - start
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "tok_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "gap_max": max(r["gap"] for r in results),
    }


def run_server(name, command, port, model_name, client_counts, new_tokens):
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, server)
        burst(port, model_name, 1, 4, seed=0)  # warm-up: first-call kernel compiles
        return {n: burst(port, model_name, n, new_tokens, seed=n) for n in client_counts}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--cadence-args", default="", help="extra `cadence serve` flags, quoted")
    parser.add_argument("--skip-peer", action="store_true", help="cadence alone (for tuning)")
    args = parser.parse_args()
    path = bench_checkpoint(args.cache_dir, vocab_size=2048)
    command = cadence_command(path, 8341, args.max_batch, args.cadence_args.split())
    ours = run_server("cadence", command, 8341, path.name, args.clients, args.new_tokens)
    if args.skip_peer:
        for n in args.clients:
            r = ours[n]
            print(f"{n:3d} clients: {r['tok_s']:6.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f}s, "
                  f"worst gap {r['gap_max']:.2f}s")
        return
    peer = run_server("mlx-lm", mlx_lm_command(path, 8342, args.max_batch), 8342, str(path),
                      args.clients, args.new_tokens)
    print(f"checkpoint: {path}; {args.new_tokens} new tokens per stream, greedy, ~100-word prompts")
    print("clients | server  |  tok/s | TTFT p50 | TTFT p99 | worst gap")
    for n in args.clients:
        for name, result in (("cadence", ours[n]), ("mlx-lm", peer[n])):
            r = result
            print(f"{n:7d} | {name:7s} | {r['tok_s']:6.1f} | {r['ttft_p50']:7.2f}s | "
                  f"{r['ttft_p99']:7.2f}s | {r['gap_max']:8.2f}s")
        print(f"{n:7d} | ratio   | {ours[n]['tok_s'] / peer[n]['tok_s']:5.2f}x | "
              f"{peer[n]['ttft_p50'] / ours[n]['ttft_p50']:6.2f}x faster TTFT p50")


if __name__ == "__main__":
    main()
