"""The config fields of some families' tiny checkpoints, each with a release's field
layout, sizes shrunk (runtime/synth_configs.py's hf_config calls these): the hybrids
(Qwen3.5, Qwen3-Next, LFM2, Granite 4.0 and Granite 3 MoE, which shares its decoder,
Nemotron-H, Falcon-H1) and those routed by DeepSeek's routers (DeepSeek-V2/V3,
GLM-4.7-Flash's MLA, GLM-4.5's GQA)."""

from __future__ import annotations

from typing import Any

QWEN3_5_FAMILIES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
HYBRID_FAMILIES = (
    *QWEN3_5_FAMILIES, "qwen3_next", "lfm2", "lfm2_moe", "granitemoehybrid", "granitemoe", "nemotron_h", "falcon_h1"
)

DEEPSEEK_STYLE_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "glm4_moe")


def hybrid_fields(
    family: str,
    raw: dict[str, Any],
    *,
    hidden_size: int,
    num_heads: int,
    head_dim: int | None,
    num_layers: int,
    intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    dense_layers: tuple[int, ...],
    granite4: dict[str, Any] | None,
    nemotron: dict[str, Any] | None,
) -> None:
    """`raw` (hf_config's common fields) given `family`'s own, in place."""
    if family == "granitemoehybrid":  # granite-4.0-h-tiny's: Mamba2 layers, every third attention, experts
        raw.update(
            attention_bias=False,
            embedding_multiplier=12.0,
            attention_multiplier=1.0 / (head_dim or hidden_size // num_heads),
            residual_multiplier=0.22,
            logits_scaling=6.0,
            layer_types=["attention" if i % 3 == 2 else "mamba" for i in range(num_layers)],
            position_embedding_type="nope",
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            shared_intermediate_size=2 * intermediate_size,
            mamba_n_heads=8,
            mamba_d_head=2 * hidden_size // 8,  # mamba_expand * hidden_size over the heads, as transformers checks
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_conv_bias=True,
            mamba_proj_bias=False,
        )
        raw.update(granite4 or {})  # the variant's own fields (e.g. num_local_experts 0, all attention)
        if not raw["num_local_experts"]:  # dense: the shared MLP alone, both widths the same as released
            raw["intermediate_size"] = raw["shared_intermediate_size"]
    if family == "granitemoe":  # Granite 3's multipliers, every layer's MLP routed experts
        raw.update(
            attention_bias=False,
            embedding_multiplier=12.0,
            attention_multiplier=1.0 / (head_dim or hidden_size // num_heads),
            residual_multiplier=0.22,
            logits_scaling=6.0,
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
        )
    if family == "nemotron_h":
        raw.update(nemotron_h_fields(raw, num_layers, num_experts, num_experts_per_tok, nemotron or {}))
    if family == "falcon_h1":  # Falcon-H1-0.5B's fields and multipliers
        raw.update(
            attention_bias=False, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
            embedding_multiplier=5.656854249492381, head_dim=head_dim or hidden_size // num_heads,
            key_multiplier=0.390625, lm_head_multiplier=0.0390625, mamba_chunk_size=128,
            mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=2 * hidden_size,
            mamba_d_state=16, mamba_expand=2, mamba_n_groups=1, mamba_n_heads=2 * hidden_size // 16,
            mamba_norm_before_gate=False, mamba_proj_bias=False, mamba_rms_norm=False, mamba_use_mlp=True,
            mlp_bias=False, mlp_expansion_factor=8, mlp_multipliers=[0.8838834764831844, 0.5859375],
            projectors_bias=False, rope_theta=100000000000.0, ssm_in_multiplier=1.25,
            ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
            ssm_out_multiplier=0.23570226039551587,
        )
        raw.update(nemotron or {})  # the variant's own fields
    if family in QWEN3_5_FAMILIES:  # Gated DeltaNet layers, every 4th full attention
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            attn_output_gate=True,
            full_attention_interval=4,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_num_key_heads=2,
            linear_value_head_dim=16,
            linear_num_value_heads=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": raw.pop("rope_theta"),
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
        del raw["rope_scaling"]
        if "moe" in family:  # every layer's MLP routed, beside a shared expert
            raw.update(
                num_experts=num_experts,
                num_experts_per_tok=num_experts_per_tok,
                moe_intermediate_size=intermediate_size,
                shared_expert_intermediate_size=2 * intermediate_size,
                norm_topk_prob=True,
            )
    if family == "qwen3_next":  # Qwen3.5's hybrid layers in its own fields; experts as qwen3_moe's
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            attention_bias=False,
            full_attention_interval=4,
            partial_rotary_factor=0.25,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_num_key_heads=2,
            linear_value_head_dim=16,
            linear_num_value_heads=4,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size,
            shared_expert_intermediate_size=2 * intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=list(dense_layers),
        )
    if family == "lfm2":  # LFM2-350M's fields: every third layer attention, the FFN width adjusted
        raw.update(
            full_attn_idxs=[i for i in range(num_layers) if i % 3 == 2],
            layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(num_layers)],
            norm_eps=raw.pop("rms_norm_eps"),
            conv_L_cache=3,
            conv_bias=False,
            block_dim=hidden_size,
            block_ff_dim=3 * intermediate_size // 2,  # adjusted: 2/3 of it, rounded up to 16
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            tie_embedding=True,
        )
        del raw["rope_scaling"], raw["hidden_act"], raw["tie_word_embeddings"]
    if family == "lfm2_moe":  # LFM2-8B-A1B's fields: its first layers dense, twice an expert's width
        raw.update(
            layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(num_layers)],
            norm_eps=raw.pop("rms_norm_eps"),
            conv_L_cache=3,
            conv_bias=False,
            intermediate_size=2 * intermediate_size,
            moe_intermediate_size=intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            num_dense_layers=len(dense_layers),
            norm_topk_prob=True,
            use_expert_bias=True,
            routed_scaling_factor=1.0,
        )
        del raw["rope_scaling"], raw["hidden_act"]


def nemotron_h_fields(
    raw: dict[str, Any], num_layers: int, num_experts: int, num_experts_per_tok: int, variant: dict[str, Any]
) -> dict[str, Any]:
    """NVIDIA-Nemotron-Nano-9B-v2's config fields (its layer pattern's rhythm, M-M-M*-),
    and where `variant`'s pattern has experts (E), Nemotron 3 Nano 30B-A3B's; `variant`
    holds the test's own fields. Like the releases: no hidden_act, rope_theta or rope_scaling."""
    for name in ("hidden_act", "rope_theta", "rope_scaling"):
        del raw[name]
    fields: dict[str, Any] = {
        "attention_bias": False, "chunk_size": 128, "conv_kernel": 4,
        "head_dim": raw["hidden_size"] // raw["num_attention_heads"],
        "hybrid_override_pattern": ("M-M*-" * num_layers)[:num_layers],
        "layer_norm_epsilon": raw["rms_norm_eps"], "mamba_head_dim": 16, "mamba_hidden_act": "silu",
        "mamba_num_heads": 8, "mamba_proj_bias": False, "mlp_bias": False, "mlp_hidden_act": "relu2",
        "n_groups": 2, "residual_in_fp32": False, "rescale_prenorm_residual": True, "ssm_state_size": 16,
        "time_step_floor": 0.0001, "time_step_limit": [0.0, float("inf")], "time_step_max": 0.1,
        "time_step_min": 0.001, "time_step_rank": 8, "use_bias": False, "use_conv_bias": True,
        "use_mamba_kernels": True,
    }
    fields.update(variant)
    if "E" in fields["hybrid_override_pattern"]:
        fields = {
            "n_routed_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": raw["intermediate_size"],
            "moe_shared_expert_intermediate_size": 2 * raw["intermediate_size"], "n_shared_experts": 1,
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "moe_latent_size": None, **fields,
        }
    return fields


def deepseek_style_fields(
    family: str,
    raw: dict[str, Any],
    *,
    hidden_size: int,
    num_heads: int,
    head_dim: int | None,
    intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    rope_scaling: dict[str, Any] | None,
) -> None:
    """`raw` (hf_config's common fields) given `family`'s own, in place."""
    if family == "deepseek_v2":  # V2-Lite's fields (no q LoRA, greedy top-k), its YaRN scaled down
        raw.update(deepseek_fields(hidden_size, num_heads, head_dim, intermediate_size, num_experts, num_experts_per_tok))
        raw["rope_scaling"] = rope_scaling or DEEPSEEK_YARN
    if family == "deepseek_v3":  # V3's: a q LoRA, the sigmoid router over 2 groups (Moonlight: 1, no YaRN)
        raw.update(deepseek_fields(hidden_size, num_heads, head_dim, intermediate_size, num_experts, num_experts_per_tok))
        raw.update(
            q_lora_rank=hidden_size // 2,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
    if family == "glm4_moe_lite":  # GLM-4.7-Flash's: V3's router over one group, one shared expert
        raw.update(deepseek_fields(hidden_size, num_heads, head_dim, intermediate_size, num_experts, num_experts_per_tok))
        raw.update(
            q_lora_rank=hidden_size // 2,
            n_shared_experts=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
            rms_norm_eps=1e-5,
            partial_rotary_factor=1.0,
            num_nextn_predict_layers=1,
        )
    if family == "glm4_moe":  # GLM-4.5-Air's fields, with GLM-4.5's qk norm and 2 router groups
        raw.update(
            attention_bias=True,
            head_dim=head_dim or hidden_size // num_heads,
            partial_rotary_factor=0.5,
            moe_intermediate_size=intermediate_size // 2,
            norm_topk_prob=True,
            n_group=2,
            topk_group=1,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            num_experts_per_tok=num_experts_per_tok,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
            use_qk_norm=True,
        )


# DeepSeek-V2-Lite's YaRN (factor 40 over 4,096 positions) scaled down to factor 4 over
# 16, so short tests run past it; mscale and mscale_all_dim differ (the releases' are
# equal) so that the rotated parts' own factor is run too.
DEEPSEEK_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}


def deepseek_fields(
    hidden_size: int, num_heads: int, head_dim: int | None, intermediate_size: int, num_experts: int, top_k: int
) -> dict[str, Any]:
    """MLA with heads of `head_dim` (K: that plus half of it rotated), a latent of half
    the hidden size; the first layer dense, the rest routed beside two shared experts."""
    nope = head_dim or hidden_size // num_heads
    return dict(
        q_lora_rank=None,
        kv_lora_rank=hidden_size // 2,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=nope // 2,
        v_head_dim=nope,
        attention_bias=False,
        n_routed_experts=num_experts,
        n_shared_experts=2,
        num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate_size,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        scoring_func="softmax",
    )
