"""Write a random-weight checkpoint shaped like Llama 3.2 1B, for serving benchmarks.

    .venv/bin/python examples/make_llama_checkpoint.py /tmp/llama-1b --dtype bfloat16
    .venv/bin/cadence bench serve --compare --checkpoint /tmp/llama-1b --clients 1 16 64 \\
        --max-batch 64 --max-tokens 128 --prompt-tokens 256

Llama 3.2 1B's geometry (hidden 2048, 16 layers, 32 query heads and 8 KV heads of 64,
MLP 8192, a tied 128,256-token vocabulary: 1.24B parameters) in bfloat16, or 4-bit at
group 64 in mlx-community's layout (`--bits 4`). The demo tokenizer (2,048 tokens)
stands in for Llama's: the rows past it are zeros, so their logits (computed, as in the
real model) are 0 and lose to the tokenizer's, and every token streams as text (an id
no tokenizer decodes streams nothing, and a bench would time no token).
`--layers` and `--hidden` cut the model down for a quick check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from runtime.synth import demo_tokenizer, make_tiny_checkpoint, quantize_weights, save_weights

import mlx.core as mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=None, help="quantize, group 64")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    start = time.perf_counter()
    out = make_tiny_checkpoint(
        args.out_dir,
        "llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=max(args.hidden // 256, 1),
        head_dim=64,
        intermediate_size=args.hidden * 4,
        tie_word_embeddings=True,
        vocab_size=128_256,
        dtype=args.dtype,
        max_position_embeddings=8192,
    )
    weights = mx.load(str(out / "model.safetensors"))
    table = weights["model.embed_tokens.weight"]
    spoken = demo_tokenizer().get_vocab_size()
    weights["model.embed_tokens.weight"] = mx.concatenate(
        [table[:spoken], mx.zeros_like(table[spoken:])]
    )
    if args.bits is not None:
        weights = quantize_weights(weights, 64, args.bits)
        config = json.loads((out / "config.json").read_text())
        config["quantization"] = {"group_size": 64, "bits": args.bits, "mode": "affine"}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    save_weights(out, weights, is_mlx_format=args.bits is not None)
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
