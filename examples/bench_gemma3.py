"""Gemma 3 in cadence: decode tok/s beside mlx-lm, and KV bytes with and without windows.

    python examples/bench_gemma3.py [--batches 1 16] [--new-tokens 64] [--prompt-tokens 256]

Builds (once, cached under .bench/) a random-weight fp32 Gemma 3 text checkpoint
shaped like the 270M model but shallower: hidden 640, 12 layers (every 6th global),
4 query heads, 1 KV head, head_dim 256, FFN 2048, the demo tokenizer's vocabulary,
sliding window 128, so a 256-token prompt decodes past the window.

1. Decode tok/s at each B: the FCFS policy and the Engine with one step of lookahead
   (examples/bench_engine.py) against mlx-lm's generate_step (B=1) and
   BatchGenerator (B>1, its rotating caches), best of interleaved repeats.
2. KV bytes of one 8,000-token sequence (prefilled in 256-token chunks, then 64
   tokens decoded): the peak the block pool held for it, measured by driving the
   scheduling policy alone, with the windowed layout and with every layer full; and
   the same for the published Gemma 3 shapes (1B, 4B, 27B; bf16 KV).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import runtime  # noqa: F401  (loads the fast BLAS before mlx)
from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.blocks import BlockPool
from runtime.kv.layout import KVLayout
from runtime.kv.paged import PagedKV
from runtime.scheduler import FcfsScheduler
from runtime.sequence import SequenceParams
from runtime.synth import make_tiny_checkpoint

import attrs
import mlx.core as mx
from bench_engine import mlx_lm_decode, ours, prompts_for
from mlx.utils import tree_flatten

SHAPE = dict(
    hidden_size=640, num_layers=12, num_heads=4, num_kv_heads=1, head_dim=256,
    intermediate_size=2048, sliding_window=128, sliding_window_pattern=6,
    max_position_embeddings=32768, tie_word_embeddings=True,
)
# (layers, KV heads, head_dim, window, every n-th layer global) of the published models.
PUBLISHED = {
    "gemma-3-1b": (26, 1, 256, 512, 6),
    "gemma-3-4b": (34, 4, 256, 1024, 6),
    "gemma-3-27b": (62, 16, 128, 1024, 6),
}
BLOCK, CHUNK = 16, 256


def bench_checkpoint(root: Path) -> Path:
    path = root / "gemma3-bench"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, "gemma3_text", seed=7, **SHAPE)  # type: ignore[arg-type]
    return path


def kv_bytes(layers: int, kv_heads: int, head_dim: int, windows: tuple, dtype: mx.Dtype) -> int:
    """Drive the policy alone (no model) over one 8,000-token row: the most KV bytes
    its blocks held at once, summed over the layer groups' pools."""
    layout = KVLayout.for_layers(layers, windows)
    layout = attrs.evolve(layout, group_num_blocks=(1 << 12,) * layout.num_groups)
    pool = BlockPool(1 << 12, BLOCK, is_caching=False, layout=layout)
    group_block_bytes = [
        PagedKV.bytes_per_block(len(group), kv_heads, head_dim, BLOCK, dtype) for group in layout.group_layers
    ]
    policy = FcfsScheduler(1, pool, 8000 + 64 + 1, CHUNK, CHUNK, CHUNK)
    policy.add("a", SequenceParams(prompt_tokens=tuple(range(8000)), max_tokens=64))
    peak = 0
    while (plan := policy.schedule()) is not None:  # None once the row is at max_tokens
        held = sum(p.num_used_blocks * b for p, b in zip(pool.group_pools, group_block_bytes, strict=True))
        peak = max(peak, held)
        policy.on_step_done(plan.step, [(s.request_id, 0, False, False) for s in plan.spans if s.samples])
    return peak


def report_kv() -> None:
    print(f"\nKV bytes for one 8,000-token sequence (+64 decoded; {CHUNK}-token chunks, block {BLOCK}):")
    print(f"{'model':<22} | {'windowed':>10} | {'all full':>10} | ratio")
    bench = {"bench checkpoint (fp32)": (12, 1, 256, 128, 6, mx.float32)}
    published = {f"{name} (bf16)": (*shape, mx.bfloat16) for name, shape in PUBLISHED.items()}
    for name, (layers, kv_heads, head_dim, window, pattern, dtype) in {**bench, **published}.items():
        windows = tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))
        windowed = kv_bytes(layers, kv_heads, head_dim, windows, dtype)
        full = kv_bytes(layers, kv_heads, head_dim, (), dtype)
        print(f"{name:<22} | {windowed / 2**20:7.1f} MiB | {full / 2**20:7.1f} MiB | {full / windowed:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench"))
    parser.add_argument("--repeats", type=int, default=2, help="best of N per cell, arms interleaved")
    parser.add_argument("--kv-only", action="store_true", help="only the KV-bytes table")
    args = parser.parse_args()
    if not args.kv_only:
        import mlx_lm

        path = bench_checkpoint(args.cache_dir)
        loaded = load_model(path)
        vocab = loaded.config.vocab_size
        engine = Engine(loaded, max_batch=max(args.batches), max_context=args.prompt_tokens + args.new_tokens + 8)
        peer, _ = mlx_lm.load(str(path))
        num_params = sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
        print(f"checkpoint: {path} ({num_params / 1e6:.0f}M params, fp32, window {SHAPE['sliding_window']})")
        print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, decode tok/s, "
              f"best of {args.repeats} interleaved runs")
        print(f"{'B':>3} | {'cadence':>8} | {'mlx-lm':>8} | ratio")
        for batch in args.batches:
            prompts = prompts_for(batch, args.prompt_tokens, vocab)
            ours_runs, peer_runs = [], []
            for _ in range(args.repeats):
                ours_runs.append(ours(engine, prompts, args.new_tokens))
                peer_runs.append(mlx_lm_decode(peer, prompts, args.new_tokens))
            best, peer_best = max(ours_runs), max(peer_runs)
            print(f"{batch:>3} | {best:8.1f} | {peer_best:8.1f} | {best / peer_best:.2f}x", flush=True)
    report_kv()


if __name__ == "__main__":
    main()
