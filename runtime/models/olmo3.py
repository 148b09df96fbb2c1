"""OLMo 3 (`olmo3`: AllenAI OLMo 3 7B and 32B, Think and Instruct): OLMo 2's layer
(olmo2.py) with sliding windows, each checked against transformers' `modeling_olmo3` and
mlx-lm's `olmo3`:

- the layers `layer_types` names sliding see their last `sliding_window` positions (without
  `layer_types`, every layer but each fourth slides, as transformers derives them);
- RoPE scaling (the long-context releases' YaRN) rotates the full layers only: the
  sliding ones rotate plainly at the same `rope_theta`.

transformers 5 may write the RoPE settings per layer type (`rope_parameters` holding
`sliding_attention` and `full_attention`); read so, each kind's rope_theta is its own and
any scaling is refused (the flat form runs every scaling config.json checks).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, ModelConfig, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.models import llama, olmo2
from runtime.models.layers import RoPE

# transformers' Olmo3Config defaults, for fields a config may leave out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "sliding_window": 4096}
DEFAULT_THETA = 500_000.0  # where no rope_theta is given at all (not a DEFAULTS entry: it would shadow rope_parameters')


def read_config(fields: ConfigFields) -> dict[str, Any]:
    is_sliding = read_sliding_layers(fields)
    if is_sliding is None:
        is_sliding = [(i + 1) % 4 != 0 for i in range(fields.get("num_hidden_layers", int))]
    window = fields.get("sliding_window", int)
    own: dict[str, Any] = {
        **olmo2.read_config(fields),
        "layer_windows": tuple(window if sliding else None for sliding in is_sliding),
    }
    rope = fields.get("rope_parameters", dict, None) or {}
    if not any(isinstance(value, dict) for value in rope.values()):  # the flat form: config.py read it
        if fields.raw.get("rope_theta") is None and "rope_theta" not in rope:
            own["rope_theta"] = DEFAULT_THETA
        return {**own, "extra": {"sliding_rope_theta": None}}
    thetas = {}
    for kind in ("sliding_attention", "full_attention"):
        settings = rope.get(kind) or {}
        if not isinstance(settings, dict) or settings.get("rope_type", "default") != "default":
            raise CheckpointError(f"{fields.source}: olmo3's rope_parameters.{kind} must be a default RoPE, got {settings!r}")
        kind_fields = ConfigFields(settings, f"{fields.source}: rope_parameters.{kind}")
        thetas[kind] = kind_fields.get("rope_theta", float, fields.get("rope_theta", float, DEFAULT_THETA))
    return {
        **own,
        "rope_theta": thetas["full_attention"],
        "rope_scaling": None,
        "extra": {"sliding_rope_theta": thetas["sliding_attention"]},
    }


class Olmo3Layer(olmo2.Olmo2Layer):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        if config.layer_windows[layer] is not None:  # a sliding layer: unscaled RoPE
            base = config.extra["sliding_rope_theta"] or config.rope_theta
            self.self_attn.rope = RoPE(config.head_dim, base, None)
            self.self_attn.scale = config.head_dim**-0.5


def build(config: ModelConfig) -> llama.Decoder:
    return llama.Decoder(config, Olmo3Layer)
