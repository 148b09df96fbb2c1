"""Write a random-weight MoE checkpoint shaped like Qwen3-30B-A3B, cut to fit a small box.

    .venv/bin/python examples/make_moe_checkpoint.py /tmp/moe-ckpt
    .venv/bin/cadence bench serve --compare --checkpoint /tmp/moe-ckpt --clients 1 4 \\
        --max-tokens 32 --prompt-tokens 100

Qwen3-30B-A3B's layer (hidden 2048, 32 query heads and 4 KV heads of 128, 8 experts a
token of 768) with 8 of its 48 layers and 32 of its 128 experts, 4-bit group 64 in
mlx-community's layout: 855 MB, ~54 s and ~6 GB of memory to write. A token runs the
same work a layer as in the full model (its 8 experts), so per-layer speed carries over;
the demo tokenizer (2,048 tokens) stands in for Qwen's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from runtime.synth import make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()
    start = time.perf_counter()
    make_tiny_checkpoint(
        args.out_dir,
        "qwen3_moe",
        hidden_size=2048,
        num_layers=args.layers,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=768,
        num_experts=args.experts,
        num_experts_per_tok=8,
        quantize=(64, 4),
        max_position_embeddings=4096,
    )
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
