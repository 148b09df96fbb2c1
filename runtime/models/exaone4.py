"""EXAONE 4.0 (`exaone4`: EXAONE-4.0-1.2B and 32B), each difference from llama checked
against transformers' `modeling_exaone4` and mlx-lm's `exaone4`:

- OLMo 2's layer (olmo2.py): no norm before attention or the MLP, each block's output
  RMSNormed before the residual add;
- q and k RMSNormed per head (as Qwen3's) before RoPE;
- with a `sliding_window`, the layers `layer_types` names sliding (without it, as
  `sliding_window_pattern` says: "LLLG", or every n-th layer full) see their last
  `sliding_window` positions with RoPE and the full ones rotate nothing (NoPE); without
  one (the 1.2B's null) every layer is full and rotates.

Its layers run by parts on the CPU, as OLMo 2's (the one-op blocks norm their input).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.models import llama, olmo2

# transformers' Exaone4Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "sliding_window": 4096, "sliding_window_pattern": 4}


def read_config(fields: ConfigFields) -> dict[str, Any]:
    llama.check_activation(fields)
    own: dict[str, Any] = {"qk_norm": True}
    window = fields.get("sliding_window", int, None)
    if window is None:  # every layer full, every layer rotating
        return own
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None:
        is_sliding = _pattern_layers(fields)
    return {
        **own,
        "layer_windows": tuple(window if sliding else None for sliding in is_sliding),
        "extra": {"rope_layers": tuple(is_sliding)},  # the full layers NoPE
    }


def _pattern_layers(fields: ConfigFields) -> list[bool]:
    """Which layers slide, from `sliding_window_pattern`: a string of L (sliding) and G
    (full) repeated over the layers, or n: every n-th layer full."""
    num_layers = fields.get("num_hidden_layers", int)
    pattern = fields.raw.get("sliding_window_pattern")
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [pattern[i % len(pattern)] == "L" for i in range(num_layers)]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    raise CheckpointError(
        f"{fields.source}: exaone4's sliding_window_pattern must be a string of 'L' and 'G' or a "
        f"positive integer, got {pattern!r}"
    )


class Exaone4Layer(olmo2.Olmo2Layer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.self_attn = llama.attention(config, layer)  # per-head q/k norms, NoPE where full


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Exaone4Layer)
