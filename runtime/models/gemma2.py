"""Gemma 2 (`gemma2`: Gemma 2 2B, 9B, 27B): Gemma 3's layer (gemma3.py: the four
(1 + w) norms, GELU-tanh, query_pre_attn_scalar, the embedding scaled by
sqrt(hidden_size) rounded to bfloat16) without its q/k norms and with one RoPE base,
plus two soft caps, each checked against transformers' `modeling_gemma2` and mlx-lm's
`gemma2`:

- every attention score s becomes c * tanh(s / c), c = `attn_logit_softcapping` (50),
  on every attention path (kernels/paged_attention.py);
- every logit z becomes c * tanh(z / c), c = `final_logit_softcapping` (30).

Layers alternate sliding (even ones, window `sliding_window`, 4096) and global, as
transformers runs them; mlx-lm runs every layer global, so the two agree below the
window. Embeddings are always tied.
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, is_positive_number, read_sliding_layers, rope_fields
from runtime.errors import CheckpointError
from runtime.models import gemma3

# transformers' Gemma2Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    activation = fields.get("hidden_activation", str, None) or fields.get("hidden_act", str, "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{fields.source}: gemma2 hidden_activation '{activation}' is not supported")
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = fields.raw.get(name)
        if value is not None and not is_positive_number(value):
            raise CheckpointError(f"{fields.source}: gemma2's {name} must be a positive number or null, got {value!r}")
        caps[name] = float(value or 0.0)  # null: no cap
    rope_theta, rope_scaling = rope_fields(fields)
    if rope_scaling is not None:  # gemma3.py's layers would scale the global layers only
        raise CheckpointError(f"{fields.source}: gemma2 with RoPE scaling is not supported")
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None:
        is_sliding = [i % 2 == 0 for i in range(fields.get("num_hidden_layers", int))]
    window = fields.get("sliding_window", int)
    return {
        "tie_word_embeddings": True,
        "layer_windows": tuple(window if sliding else None for sliding in is_sliding),
        "extra": {
            "query_pre_attn_scalar": fields.get("query_pre_attn_scalar", float),
            "rope_local_base_freq": rope_theta,  # one base for every layer
            **caps,
        },
    }


# Gemma 3's model, whose logits take the final cap too (its `project`).
build = gemma3.Gemma3
rename_weights = gemma3.rename_weights
