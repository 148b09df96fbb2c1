"""SmolLM3 (`smollm3`): llama's decoder with no rotary embedding in some layers (NoPE).

`no_rope_layers` holds a 1 for each layer that rotates q and k and a 0 for one that
does not; without it every `no_rope_layer_interval`-th layer (the fourth) does not, as
transformers and mlx-lm derive it. Without `layer_types`, `use_sliding_window` makes the
NoPE layers slide over `sliding_window` positions, as transformers derives it (every
released config says false).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields, read_sliding_layers
from runtime.errors import CheckpointError
from runtime.models import llama

build = llama.Decoder


def read_config(fields: ConfigFields) -> dict[str, Any]:
    num_layers = fields.get("num_hidden_layers", int)
    flags = fields.get("no_rope_layers", list, None)
    if flags is None:
        interval = fields.get("no_rope_layer_interval", int, 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers or not all(f in (0, 1) and not isinstance(f, float) for f in flags):
        raise CheckpointError(
            f"{fields.source}: no_rope_layers must hold a 0 or 1 for each of the {num_layers} layers, got {flags!r}"
        )
    rope_layers = tuple(bool(f) for f in flags[:num_layers])
    llama.check_activation(fields)
    bias = fields.get("attention_bias", bool, False)
    windows: tuple[int | None, ...] = ()
    if read_sliding_layers(fields) is not None:
        windows = llama.sliding_windows(fields)
    elif fields.get("use_sliding_window", bool, False) and (window := fields.get("sliding_window", int, None)):
        windows = tuple(None if rotates else window for rotates in rope_layers)
    return {"qkv_bias": bias, "o_bias": bias, "layer_windows": windows, "extra": {"rope_layers": rope_layers}}
