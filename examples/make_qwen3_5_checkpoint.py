"""Write a random-weight fp32 checkpoint shaped like Qwen3.5-0.8B's text model, for benches.

    .venv/bin/python examples/make_qwen3_5_checkpoint.py /tmp/qwen3_5-ckpt
    .venv/bin/cadence bench serve --compare --checkpoint /tmp/qwen3_5-ckpt --clients 1 8 \\
        --max-tokens 32 --prompt-tokens 150 --rounds 1

Qwen3.5-0.8B's geometry (hidden 1024, 24 layers: three Gated DeltaNet layers of 16 key
and 16 value heads of 128 to one gated attention layer of 8 query and 2 KV heads of
256, FFN 3584, a quarter of each head rotated) with the demo tokenizer's 2,048 tokens
for its 248K: ~500M parameters, 2.0 GB, written in mlx-lm's layout (conv weights
[C, K, 1], norms as stored), so mlx_lm.server loads it too.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.checkpoint import DEMO_CHECKPOINT
from runtime.config import config_from_dict
from runtime.models import build_model

import mlx.core as mx
from mlx.utils import tree_flatten

CONFIG = {
    "model_type": "qwen3_5",  # a flat text config, as mlx-lm also reads it
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 3584,
    "vocab_size": 2048,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "torch_dtype": "float32",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=24, help="a multiple of 4 keeps the 3:1 mix")
    args = parser.parse_args()
    config = {**CONFIG, "num_hidden_layers": args.layers}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(0)
    weights = {}
    for name, like in tree_flatten(build_model(config_from_dict(config)).parameters()):
        if name.endswith("norm.weight") or name.endswith("dt_bias"):
            value = mx.ones(like.shape)
        elif name.endswith("A_log"):  # decay rates as the releases initialise them: A in [1, 16]
            value = mx.log(mx.random.uniform(1, 16, like.shape))
        else:
            value = mx.random.normal(like.shape) * 0.02
        weights[name] = value.astype(mx.float32)
    mx.save_safetensors(str(args.out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_CHECKPOINT / name, args.out_dir / name)
    print(f"{args.out_dir}: {sum(w.size for w in weights.values()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
