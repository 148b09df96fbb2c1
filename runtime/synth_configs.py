"""The config.json a tiny test checkpoint of each family gets (runtime/synth.py): the
fields Hugging Face writes for it, at the sizes a test asks for."""

from __future__ import annotations

from typing import Any

from runtime.models import FAMILIES
from runtime.synth_family_fields import (
    DEEPSEEK_STYLE_FAMILIES,
    HYBRID_FAMILIES,
    deepseek_style_fields,
    hybrid_fields,
)

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
    if family in DEEPSEEK_STYLE_FAMILIES:  # routed by DeepSeek's routers (runtime/synth_family_fields.py)
        deepseek_style_fields(
            family, raw, hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
            intermediate_size=intermediate_size, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            rope_scaling=rope_scaling,
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
    if family in HYBRID_FAMILIES:  # layers that keep a recurrent state (runtime/synth_family_fields.py)
        hybrid_fields(
            family, raw, hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, num_layers=num_layers,
            intermediate_size=intermediate_size, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            dense_layers=dense_layers, granite4=granite4, nemotron=nemotron,
        )
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
