"""Quantized weights on the CPU: cadence's kernels against the fp32 expansion (issue 11).

    python examples/bench_cpu_kernels.py [--bits 4|8|16] [--decode-tokens 128]

Writes a random-weight checkpoint with SmolLM2-135M's geometry (hidden 576, 30 layers,
9 heads / 3 KV heads, FFN 1536, vocab 49152, tied embeddings) quantized to `--bits`
(group 64; 16: float16, unquantized), then runs each configuration in its own process
(so peak memory is its own):

  - "kernels": the quantized weights kept, cadence's C++ kernels (the default on CPU);
  - "fp32": CADENCE_CPU_KERNELS=off, the weights expanded to float32 (OpenBLAS);
  - with --bits 16: "16-bit storage" (the default: the linear weights kept in 16 bits,
    computed in float32), "fp32" (`--cpu-quantize float32`), "cpu-quantize 8" and "4".

and prints single-stream decode tok/s, B=16 decode tok/s, a 512-token prefill and peak
memory.

With `--llama-cpp-python PYTHON` (an interpreter where `import llama_cpp` works; it
need not be this one), or without it when this interpreter can import llama_cpp, the
same random weights are also written as a Q4_1 GGUF, and single-stream decode runs on
that one file in three alternating rounds: through llama.cpp
(its low-level API, `llama_decode` a token at a time, 2 threads, greedy on the logits,
EOS ignored) and through cadence (which repacks Q4_1 as mlx 4-bit group 32, so its
kernels run it); the best round of each and their ratio are printed. Figures on a
shared or busy machine are noisy: run it twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHECKPOINT_DIR = Path(".bench") / "smollm2-135m-geometry"
SMOLLM2_135M = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


def make_checkpoint(bits: int) -> Path:
    import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
    from runtime.synth import make_tiny_checkpoint

    path = CHECKPOINT_DIR.with_name(f"{CHECKPOINT_DIR.name}-{'f' if bits == 16 else 'q'}{bits}")
    if not (path / "config.json").exists():
        if bits == 16:
            make_tiny_checkpoint(path, "llama", dtype="float16", **SMOLLM2_135M)
        else:
            make_tiny_checkpoint(path, "llama", quantize=(64, bits), **SMOLLM2_135M)
    return path


def measure(
    path: Path, decode_tokens: int, cpu_quantize: str, single_stream_only: bool = False
) -> dict[str, float | str]:
    """Runs in the child process: load, then time the engine on each workload."""
    import resource

    import runtime  # noqa: F401
    from runtime.checkpoint import load_model
    from runtime.engine import Engine
    from runtime.kv.blocks import BlockPool
    from runtime.runner import run_offline
    from runtime.scheduler import FcfsScheduler
    from runtime.sequence import SequenceParams

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kernels.cpu_extension import kernel_status

    lines: list[str] = []
    loaded = load_model(path, cpu_quantize=cpu_quantize, on_progress=lines.append)
    weights_mb = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters())) / 1e6
    engine = Engine(loaded, max_batch=16, max_context=1024)

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size, is_caching=False)
        policy = FcfsScheduler(16, pool, engine.max_context, 512, 512 + 16, 0)
        requests = {
            str(i): SequenceParams(prompt_tokens=tuple(p), max_tokens=max_tokens, ignore_eos=True)
            for i, p in enumerate(prompts)
        }
        start = time.perf_counter()
        run_offline(engine, policy, requests, lookahead=1)
        return time.perf_counter() - start

    def prompt(n: int, salt: int) -> list[int]:
        return [(i * 37 + salt * 101) % 2000 + 3 for i in range(n)]

    run([prompt(16, 0)], 8)  # warm-up
    one = run([prompt(16, 1)], 1)
    single = decode_tokens / (run([prompt(16, 1)], decode_tokens + 1) - one)
    if single_stream_only:
        return {"status": kernel_status(), "decode_tok_s": single}
    batch = [prompt(16, s) for s in range(16)]
    batch_first = run(batch, 1)
    batch_rate = 16 * 32 / (run(batch, 33) - batch_first)
    prefill = min(run([prompt(512, s)], 1) for s in (2, 3))
    return {
        "status": kernel_status(),
        "weights": next((line for line in lines if line.startswith("weights")), ""),
        "decode_tok_s": single,
        "batch16_tok_s": batch_rate,
        "prefill512_s": prefill,
        "weights_mb": weights_mb,
        "peak_mlx_mb": mx.get_peak_memory() / 1e6,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }


def run_child(
    path: Path,
    decode_tokens: int,
    kernels: bool,
    cpu_quantize: str = "off",
    single_stream_only: bool = False,
) -> dict[str, float | str]:
    env = dict(os.environ)
    if not kernels:
        env["CADENCE_CPU_KERNELS"] = "off"
    command = [sys.executable, __file__, "--child", str(path)]
    command += ["--decode-tokens", str(decode_tokens), "--cpu-quantize", cpu_quantize]
    command += ["--single-stream-only"] if single_stream_only else []
    out = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# llama-cpp-python's low-level API: llama_decode one token at a time, greedy on its logits.
LLAMA_CPP_DECODE = """
import sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, n = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=512, verbose=False)
ctx, vocab = llm.ctx, llm.n_vocab()
prompt = [(i * 37 + 101) % 2000 + 3 for i in range(16)]
def feed(tokens):
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(tokens))) != 0:
        raise RuntimeError("llama_decode failed")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
    return int(logits.argmax())
def decode(count):
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    token = feed(prompt)
    start = time.perf_counter()
    for _ in range(count):
        token = feed([token])
    return count / (time.perf_counter() - start)
decode(8)
print(max(decode(n) for _ in range(2)))
"""


def write_q4_1_gguf() -> Path:
    import runtime  # noqa: F401
    from runtime.gguf_synth import write_gguf
    from runtime.synth import make_tiny_checkpoint

    from gguf import GGMLQuantizationType

    out = CHECKPOINT_DIR.with_name(f"{CHECKPOINT_DIR.name}-q4_1.gguf")
    if not out.exists():
        full = make_tiny_checkpoint(CHECKPOINT_DIR.with_name(f"{CHECKPOINT_DIR.name}-f32"), "llama", **SMOLLM2_135M)
        write_gguf(full, out, CHECKPOINT_DIR.with_name(f"{CHECKPOINT_DIR.name}-q4_1-reference"),
                   GGMLQuantizationType.Q4_1)
    return out


def llama_cpp_peer(python: str, decode_tokens: int, rounds: int = 3) -> None:
    """Both on one Q4_1 file, in alternating rounds (the box's speed drifts by ~10%
    between runs): each side's best round, and the ratio of the bests."""
    gguf_file = write_q4_1_gguf()
    llama, ours = [], []
    status = ""
    for _ in range(rounds):
        out = subprocess.run(
            [python, "-c", LLAMA_CPP_DECODE, str(gguf_file), str(decode_tokens)],
            capture_output=True, text=True, check=True,
        )
        llama.append(float(out.stdout.strip().splitlines()[-1]))
        row = run_child(gguf_file, decode_tokens, True, single_stream_only=True)
        ours.append(float(row["decode_tok_s"]))
        status = str(row["status"])
    print(f"same Q4_1 GGUF ({gguf_file.name}), single-stream decode tok/s, {rounds} alternating rounds:")
    print("| runtime | best | rounds |")
    print("|---|---|---|")
    print(f"| llama.cpp (2 threads, llama_decode) | {max(llama):.1f} | {' / '.join(f'{r:.1f}' for r in llama)} |")
    print(f"| cadence ({status}) | {max(ours):.1f} | {' / '.join(f'{r:.1f}' for r in ours)} |")
    print(f"| cadence / llama.cpp | {max(ours) / max(llama):.2f}x | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, choices=(4, 8, 16), default=4)
    parser.add_argument("--cpu-quantize", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--llama-cpp-python", help="an interpreter that can import llama_cpp")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--single-stream-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        row = measure(args.child, args.decode_tokens, args.cpu_quantize, args.single_stream_only)
        print(json.dumps(row))
        return
    path = make_checkpoint(args.bits)
    print(f"model: {path} ({args.bits}-bit, SmolLM2-135M geometry, random weights)")
    if args.bits == 16:
        rows = {"16-bit storage": run_child(path, args.decode_tokens, True)}
        rows["fp32"] = run_child(path, args.decode_tokens, True, "float32")
        for bits in ("8", "4"):
            rows[f"cpu-quantize {bits}"] = run_child(path, args.decode_tokens, True, bits)
    else:
        rows = {"kernels": run_child(path, args.decode_tokens, True)}
        rows["fp32"] = run_child(path, args.decode_tokens, False)
    for name, row in rows.items():
        print(f"  {name}: {row['status']}")
        print(f"  {name}: {row['weights']}")
    print("peak memory includes the KV pool (16 rows x 1024 tokens); weights are the parameters")
    print("| config | decode tok/s | B=16 decode tok/s | prefill 512 (s) | weights MB | peak mlx MB | max RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['decode_tok_s']:.1f} | {row['batch16_tok_s']:.1f} | "
            f"{row['prefill512_s']:.3f} | {row['weights_mb']:.0f} | {row['peak_mlx_mb']:.0f} | "
            f"{row['max_rss_mb']:.0f} |"
        )
    peer = args.llama_cpp_python
    if peer is None and importlib.util.find_spec("llama_cpp") is not None:
        peer = sys.executable  # importable here: the peer runs in this interpreter
    if peer:
        llama_cpp_peer(peer, args.decode_tokens)
    else:
        print("llama.cpp: not measured (llama_cpp is not importable here; pass --llama-cpp-python)")


if __name__ == "__main__":
    main()
