"""GLM-4.7-Flash (`glm4_moe_lite`, 30B-A3B): DeepSeek-V3's layout (deepseek_v3.py: MLA,
its sigmoid router, both weight layouts, the multi-token-prediction layer dropped), as
mlx-lm's `glm4_moe_lite` runs it. Its one difference: q_a_layernorm and kv_a_layernorm
take the config's `rms_norm_eps` (DeepSeek's code fixes them at 1e-6). Its heads: q.k
192 + 64 wide, v 256, so nothing is padded in the KV store (see deepseek_v2.py).
"""

from __future__ import annotations

from typing import Any

from runtime.config import ConfigFields
from runtime.models import deepseek_v2, deepseek_v3

import attrs

# transformers' Glm4MoeLiteConfig defaults (its mlp_layer_types: the first layer dense,
# as mlx-lm's; every norm's eps 1e-5), for fields a config may leave out.
DEFAULTS = {"first_k_dense_replace": 1, "rms_norm_eps": 1e-5}
build = deepseek_v2.build
EXPERT_NAMES = deepseek_v2.EXPERT_NAMES  # stored: ours
rename_weights = deepseek_v3.rename_weights


def read_config(fields: ConfigFields) -> dict[str, Any]:
    read = deepseek_v3.read_config(fields)
    mla = attrs.evolve(read["extra"]["mla"], norm_eps=fields.get("rms_norm_eps", float))
    return {**read, "extra": {**read["extra"], "mla": mla}}
