"""The config.json a tiny test checkpoint of each family gets (runtime/synth.py): the
fields Hugging Face writes for it, at the sizes a test asks for."""

from __future__ import annotations

from typing import Any

from runtime.models import FAMILIES

import mlx.core as mx

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "apertus": "ApertusForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "phi": "PhiForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "internlm3": "InternLM3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
# Qwen's vision-language layouts, by the text family whose fields they hold.
QWEN_VL_TEXT = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
# Ministral 3's settings with an original context of 16 (the releases': 16,384); the
# factor is the ratio of max_position_embeddings to it, as in the releases.
QWEN3_5_FAMILIES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
MINISTRAL3_ROPE = {
    "factor": 16.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def hf_config(
    family: str,
    *,
    vocab_size: int,
    eos_token_id: list[int],
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    max_position_embeddings: int = 1024,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    sliding_window: int = 8,
    sliding_window_pattern: int = 2,
    query_pre_attn_scalar: int = 24,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    dense_layers: tuple[int, ...] = (),
    text_family: str = "ministral3",
    gemma4: dict[str, Any] | None = None,
    granite4: dict[str, Any] | None = None,
    nemotron: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A config.json dict with the fields Hugging Face writes for `family`."""
    if family == "mistral3":  # the multimodal layout: the text model's config nested
        text = hf_config(
            text_family, vocab_size=vocab_size, eos_token_id=eos_token_id, hidden_size=hidden_size,
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size, head_dim=head_dim,
            tie_word_embeddings=tie_word_embeddings, dtype=dtype,
            max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling,
            rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
        )
        moved = {name: text.pop(name) for name in ("eos_token_id", "torch_dtype")}
        del text["architectures"]
        return {
            "architectures": [ARCHITECTURES[family]],
            "model_type": family,
            **moved,
            "text_config": text,
            "vision_config": {"model_type": "pixtral", "hidden_size": 8},
        }
    if family in QWEN_VL_TEXT:
        text = hf_config(
            QWEN_VL_TEXT[family], vocab_size=vocab_size, eos_token_id=eos_token_id, hidden_size=hidden_size,
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size, head_dim=head_dim,
            tie_word_embeddings=tie_word_embeddings, dtype=dtype,
            max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling,
            rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok, dense_layers=dense_layers,
        )
        return qwen_vl_config(family, text, rope_scaling)
    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}' (known: {', '.join(sorted(FAMILIES))})")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "eos_token_id": eos_token_id,
    }
    if family in ("llama", "qwen3", "smollm3"):
        raw["attention_bias"] = False
    if family == "smollm3":  # every fourth layer without RoPE, as the releases
        raw.update(no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None)
    if family in ("mistral", "mixtral", "ministral3"):
        raw["sliding_window"] = None
    if family == "ministral3":  # transformers 5's layout: every RoPE setting in one dict
        raw["rope_parameters"] = {
            "rope_type": "yarn",
            "type": "yarn",
            "rope_theta": raw.pop("rope_theta"),
            **(raw.pop("rope_scaling") or MINISTRAL3_ROPE),
        }
        if rope_scaling is None:  # the factor transformers expects from the two contexts
            raw["rope_parameters"]["factor"] = max_position_embeddings / 16
        raw["head_dim"] = head_dim or hidden_size // num_heads
    if family == "mixtral":
        raw.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    if family == "gpt_oss":  # every other layer slides, from the first, as the releases
        raw.update(
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            head_dim=head_dim or hidden_size // num_heads,
            attention_bias=True,
            sliding_window=sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            swiglu_limit=7.0,
        )
    if family == "qwen2_moe":
        raw.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size,
            shared_expert_intermediate_size=2 * intermediate_size,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=list(dense_layers),
        )
    if family == "qwen3_moe":
        raw.update(
            attention_bias=False,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=list(dense_layers),
        )
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
    if family == "phi3":
        raw.update(attention_bias=False, sliding_window=None)
        raw["original_max_position_embeddings"] = max_position_embeddings
    # Qwen3 configs always name head_dim (and mlx-lm requires it there).
    if head_dim is not None or family in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"):
        raw["head_dim"] = head_dim or hidden_size // num_heads
    if family in ("gemma3_text", "gemma3"):
        raw.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=query_pre_attn_scalar,
            rope_theta=1_000_000.0,
            rope_local_base_freq=rope_theta,
            sliding_window=sliding_window,
            sliding_window_pattern=sliding_window_pattern,
            layer_types=[
                "full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
        del raw["hidden_act"]
    if family == "gemma":  # the releases' legacy "gelu" beside the name transformers runs
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            hidden_act="gelu",
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
        del raw["rope_scaling"]
    if family == "granite":  # Granite 3's multipliers (its attention's is 1 / head_dim)
        raw.update(
            attention_bias=False,
            mlp_bias=False,
            embedding_multiplier=12.0,
            attention_multiplier=1.0 / (head_dim or hidden_size // num_heads),
            residual_multiplier=0.22,
            logits_scaling=8.0,
        )
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
    if family == "olmo2":
        raw["attention_bias"] = False
    if family == "olmo3":  # every fourth layer full, as the releases
        raw.update(
            attention_bias=False,
            sliding_window=sliding_window,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)],
        )
    if family == "glm4":  # half of each head rotated, in interleaved pairs
        raw.update(head_dim=head_dim or hidden_size // num_heads, partial_rotary_factor=0.5, attention_bias=True)
        del raw["rope_scaling"]
    if family in ("cohere", "cohere2"):  # Command-R's and R7B's fields (R7B's originals beside transformers')
        raw.update(attention_bias=False, layer_norm_eps=1e-5, logit_scale=0.0625, use_qk_norm=False, tie_word_embeddings=True)
        del raw["rms_norm_eps"]
    if family == "cohere2":  # three sliding layers in four, the fourth full without RoPE
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            logit_scale=0.25,
            sliding_window=sliding_window,
            sliding_window_pattern=4,
            order_of_interleaved_layers="local_attn_first",
            position_embedding_type="rope_gptj",
            rotary_pct=1.0,
            use_embedding_sharing=True,
            use_gated_activation=True,
            use_parallel_block=True,
            use_parallel_embedding=True,
            cache_implementation="hybrid",
        )
        del raw["use_qk_norm"]
    if family == "exaone4":  # the 32B's layout: three sliding layers in four, the fourth full without RoPE
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            sliding_window=sliding_window,
            sliding_window_pattern="LLLG",
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)],
        )
    if family == "ernie4_5":  # ERNIE-4.5-0.3B's fields
        raw.update(head_dim=head_dim or hidden_size // num_heads, use_bias=False)
    if family == "seed_oss":  # Seed-OSS-36B's: q/k/v biased, o not
        raw.update(head_dim=head_dim or hidden_size // num_heads, attention_bias=True, attention_out_bias=False, mlp_bias=False)
    if family == "apertus":  # Apertus 8B's fields: xIELU, q/k norms, llama3 RoPE (as `rope_scaling` gives)
        raw.update(hidden_act="xielu", attention_bias=False, mlp_bias=False, post_norm=False, qk_norm=True)
    if family == "olmoe":  # OLMoE-1B-7B's fields: every MLP routed, experts intermediate_size wide
        raw.update(
            attention_bias=False,
            clip_qkv=None,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            norm_topk_prob=False,
            router_aux_loss_coef=0.01,
            output_router_logits=False,
        )
    if family == "stablelm":  # StableLM 2 1.6B's fields (the 12B's: qk_layernorm and use_parallel_residual true)
        raw.update(
            layer_norm_eps=1e-5,
            partial_rotary_factor=0.25,
            use_qkv_bias=True,
            qk_layernorm=False,
            use_parallel_residual=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        del raw["rms_norm_eps"]
    if family == "phi":  # phi-2's fields
        raw.update(
            hidden_act="gelu_new",
            layer_norm_eps=1e-5,
            partial_rotary_factor=0.4,
            qk_layernorm=False,
            embd_pdrop=0.0,
            resid_pdrop=0.1,
            attention_dropout=0.0,
        )
        del raw["rms_norm_eps"]
    if family == "starcoder2":  # StarCoder2-3B's fields, its window `sliding_window`
        raw.update(
            hidden_act="gelu_pytorch_tanh",
            norm_epsilon=1e-5,
            norm_type="layer_norm",
            mlp_type="default",
            use_bias=True,
            sliding_window=sliding_window,
            embedding_dropout=0.0,
            residual_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=True,
        )
        del raw["rms_norm_eps"]
    if family == "hunyuan_v1_dense":  # Hunyuan-7B-Instruct's fields: q/k norms after RoPE, NTK alpha
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            attention_head_dim=head_dim or hidden_size // num_heads,
            attention_bias=False,
            mlp_bias=False,
            use_qk_norm=True,
            use_cla=False,
            use_rotary_pos_emb=True,
            norm_type="rms",
            rope_scaling=rope_scaling or {
                "alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                "mscale_all_dim": 1.0, "type": "dynamic",
            },
        )
    if family == "internlm3":  # internlm3-8b-instruct's fields: dynamic NTK past the context
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            bias=False,
            qkv_bias=False,
            rope_scaling=rope_scaling or {"factor": 6.0, "rope_type": "dynamic"},
        )
    if family == "gemma2":
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=query_pre_attn_scalar,
            sliding_window=sliding_window,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
        del raw["hidden_act"], raw["rope_scaling"]
    if family in ("gemma4_text", "gemma4"):
        raw.update(
            head_dim=head_dim or hidden_size // num_heads,
            global_head_dim=2 * (head_dim or hidden_size // num_heads),
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=sliding_window,
            sliding_window_pattern=sliding_window_pattern,
            layer_types=[
                "full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": rope_theta},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            },
            final_logit_softcapping=30.0,
            attention_k_eq_v=False,
            num_global_key_value_heads=None,
            num_kv_shared_layers=0,
            use_double_wide_mlp=False,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=vocab_size,
            enable_moe_block=False,
        )
        raw.update(gemma4 or {})  # the variant's own fields
        if raw["enable_moe_block"]:
            raw.update(num_experts=num_experts, top_k_experts=num_experts_per_tok, moe_intermediate_size=intermediate_size)
        del raw["hidden_act"], raw["rope_theta"], raw["rope_scaling"]
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
    if family in ("qwen3_5", "qwen3_5_moe"):  # the multimodal layout: the text model's config nested
        text = {**raw, "model_type": f"{family}_text"}
        outer = ("architectures", "eos_token_id", "torch_dtype", "tie_word_embeddings")
        for name in outer[:-1]:  # tying is said in both, as the releases do
            text.pop(name)
        raw = {name: raw[name] for name in outer}
        raw.update(model_type=family, text_config=text, vision_config={"model_type": "qwen3_5", "hidden_size": 8})
    if family in ("gemma3", "gemma4"):  # the multimodal layout: the text model's config nested
        text = {**raw, "model_type": f"{family}_text"}
        outer = ("architectures", "eos_token_id", "torch_dtype", "vocab_size")
        for name in outer + ("tie_word_embeddings",):
            text.pop(name)
        raw = {name: raw[name] for name in outer}
        raw.update(
            model_type=family,
            text_config=text,
            vision_config={"model_type": "siglip_vision_model", "hidden_size": 8},
            tie_word_embeddings=tie_word_embeddings,
        )
    return raw


def qwen_vl_config(family: str, text: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Qwen's vision-language layouts, as the releases write them: Qwen2-VL's and
    Qwen2.5-VL's flat (Qwen2.5-VL-3B-Instruct's), Qwen3-VL's nested under `text_config`
    (Qwen3-VL-4B-Instruct's, Qwen3-VL-30B-A3B-Instruct's); a multimodal RoPE whose
    sections fill half a head, as theirs (`rope_scaling` replaces it)."""
    half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    del text["architectures"]
    tokens = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653}
    if family in ("qwen2_vl", "qwen2_5_vl"):
        spatial = 3 * half // 8  # [16, 24, 24] in the releases' 128-wide heads
        mrope: dict[str, Any] = {"type": "mrope", "mrope_section": [half - 2 * spatial, spatial, spatial]}
        return {
            "architectures": [ARCHITECTURES[family]],
            **text,
            "model_type": family,
            "rope_scaling": rope_scaling or mrope,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "max_window_layers": 70,
            "vision_token_id": 151654,
            **tokens,
            "vision_config": {"depth": 2, "hidden_size": 8, "out_hidden_size": text["hidden_size"]},
        }
    spatial = 5 * half // 16  # [24, 20, 20] in the releases' 128-wide heads
    mrope = {"mrope_interleaved": True, "mrope_section": [half - 2 * spatial, spatial, spatial], "rope_type": "default"}
    text.update(model_type=f"{family}_text", rope_scaling=rope_scaling or mrope, dtype=text.pop("torch_dtype"))
    return {
        "architectures": [ARCHITECTURES[family]],
        **tokens,
        "model_type": family,
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "vision_config": {"model_type": family, "depth": 2, "hidden_size": 8, "deepstack_visual_indexes": [0, 1]},
    }
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
