"""The model's shape, read from a Hugging Face `config.json` and checked field by field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeGuard

from runtime.errors import CheckpointError
from runtime.files import is_present, read_json

import attrs
import structlog

log = structlog.get_logger("cadence.load")

# mlx's quantization modes (`mode` in config.json's `quantization`; mlx-lm's `--q-mode`):
# affine stores `.scales` and `.biases`, the microscaling ones `.scales` alone.
QUANTIZATION_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")

# mlx's shapes are int32: a larger size raised OverflowError deep inside mlx.
MAX_INT_FIELD = 2**31 - 1
# Far above any real model's depth (the deepest have ~130 layers), so a config's
# layer count can be checked against the weights before per-layer lists are built.
MAX_LAYERS = 10_000


@attrs.frozen
class Quantization:
    group_size: int
    bits: int
    # Mixed-precision checkpoints: {module path: (group_size, bits, mode)} overriding the
    # default; None is the mode's default (mlx's).
    per_layer: dict[str, tuple[int | None, int | None, str]] = attrs.field(factory=dict)
    mode: str = "affine"


@attrs.frozen
class ModelConfig:
    """Everything the decoder needs; field names follow Hugging Face's.

    The fields every family shares are read here; a family's own fields are read by
    its file under runtime/models/ (`read_config`) and land in the flags below or in
    `extra`.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    # None: config.json does not say, and the load decides from the weights (tied when
    # they hold no lm_head.weight); a model built before that has an lm_head.
    tie_word_embeddings: bool | None
    quantization: Quantization | None
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2; llama's attention_bias)
    o_bias: bool = False  # o_proj carries a bias (llama/qwen3 attention_bias; never qwen2)
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k before RoPE
    # Per layer: the keys a query sees in a sliding-window layer (itself included),
    # or None for full attention. Empty: every layer is full.
    layer_windows: tuple[int | None, ...] = ()
    # Per layer that stores K/V: its (KV heads, head dim), where they differ by layer
    # (Gemma 4's full layers); empty: every layer's are the two fields above.
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    # How many layers, the first ones, store K/V; the rest read an earlier layer's
    # (Gemma 4's KV-shared layers); in a hybrid model, its attention layers (the
    # linear-attention ones keep a recurrent state instead). None: every layer stores its own.
    num_kv_layers: int | None = None
    # A hybrid model's recurrent state, per row: its bytes (0: none; runtime/kv/recurrent.py).
    recurrent_row_bytes: int = 0
    extra: dict[str, Any] = attrs.field(factory=dict)  # the family's own settings
    # config.json's `quantization_config.quant_method` when it has no MLX `quantization`
    # (GPTQ, AWQ, bitsandbytes, fp8, ...): named if the weights then do not fit.
    foreign_quantization: str | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_layers(self) -> int:
        """Layers that store K/V (the KV pools' layers)."""
        return self.num_hidden_layers if self.num_kv_layers is None else self.num_kv_layers

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


class ConfigFields:
    """Typed, checked reads of a config dict; every failure is one CheckpointError line."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def get(self, name: str, kind: type, default: Any = attrs.NOTHING) -> Any:
        value = self.raw.get(name, default)
        if value is attrs.NOTHING:
            raise CheckpointError(f"{self.source}: missing required field '{name}'")
        if value is None and default is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(
                f"{self.source}: field '{name}' should be {kind.__name__}, got {value!r}"
            )
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes `<= 0`
            raise CheckpointError(f"{self.source}: field '{name}' must be a finite number, got {value}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise CheckpointError(f"{self.source}: field '{name}' must be positive, got {value}")
        if isinstance(value, int) and value > MAX_INT_FIELD:
            raise CheckpointError(
                f"{self.source}: field '{name}' is too large, got {value} (at most {MAX_INT_FIELD})"
            )
        return value


def load_config(path: Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` for EOS ids) in a checkpoint directory."""
    config_file = path / "config.json"
    raw = _read_json(config_file, required=True)
    assert raw is not None  # required=True raised otherwise
    return config_from_dict(raw, _read_generation_config(path), source=str(config_file))


def _read_generation_config(path: Path) -> dict[str, Any] | None:
    """generation_config.json, or None where there is none or it cannot be read. It
    adds EOS ids alone, and as transformers (whose from_pretrained catches the error and
    derives one from config.json) and mlx-lm (which skips invalid JSON) load a checkpoint
    whose copy is broken, so does this, with a warning: it was refused, config.json and
    the weights sound."""
    try:
        return _read_json(path / "generation_config.json", required=False)
    except CheckpointError as error:
        log.warning("generation_config.json skipped", problem=str(error))
        return None


def config_from_dict(
    raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config.json"
) -> ModelConfig:
    from runtime.models import FAMILIES  # the families import this module

    model_type = ConfigFields(raw, source).get("model_type", str)
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise CheckpointError(
            f"{source}: unsupported model_type '{model_type}' (supported: {supported})"
        )
    family = FAMILIES[model_type]
    if hasattr(family, "unwrap_config"):
        raw = family.unwrap_config(raw, source)
        family = FAMILIES[raw["model_type"]]  # the text model's (mistral3 -> mistral or ministral3)
    raw = {**getattr(family, "DEFAULTS", {}), **raw}
    fields = ConfigFields(raw, source)
    field = fields.get
    hidden = field("hidden_size", int)
    heads = field("num_attention_heads", int)
    # Null as well as left out is one KV head per query head, as transformers' llama,
    # mistral and qwen configs read it (and mlx-lm's llama); null was refused.
    kv_heads = field("num_key_value_heads", int, None) or heads
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = field("head_dim", int, None) or hidden // heads
    if head_dim == 0:  # RoPE and the attention scale divide by it
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is larger than hidden_size ({hidden}) "
            "and no head_dim is given"
        )
    num_layers = field("num_hidden_layers", int)
    if num_layers > MAX_LAYERS:  # before the family's read_config builds per-layer lists
        raise CheckpointError(
            f"{source}: field 'num_hidden_layers' is {num_layers}, more than {MAX_LAYERS}"
        )
    if field("mlp_bias", bool, False):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    # Older MLX conversions may say so (Hugging Face configs never do): RoPE rotating
    # interleaved pairs, which mlx-lm honours; run as halves, every token was off.
    if field("rope_traditional", bool, False):
        raise CheckpointError(f"{source}: rope_traditional=true is not supported")
    rope_theta, rope_scaling = rope_fields(fields)
    _check_full_rotation(fields, rope_scaling, getattr(family, "ROTATES_PART_OF_A_HEAD", False))
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        # A family may run more (phi3's LongRoPE): its read_config checks those.
        own_types = getattr(family, "ROPE_TYPES", ())
        rope_types = ("default", "linear", "llama3", "yarn", *own_types)
        if rope_type not in rope_types:
            raise CheckpointError(
                f"{source}: unsupported rope_scaling type '{rope_type}' "
                f"(supported: {', '.join(rope_types)})"
            )
        if rope_type == "yarn":
            rope_scaling = _complete_yarn(rope_scaling, rope_theta, field("max_position_embeddings", int, 4096), source)
        elif rope_type not in own_types:
            _check_rope_scaling(rope_type, rope_scaling, source)
    common: dict[str, Any] = dict(
        model_type=raw["model_type"],
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=field("intermediate_size", int),
        vocab_size=field("vocab_size", int),
        rms_norm_eps=field("rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=field("max_position_embeddings", int, 4096),
        tie_word_embeddings=field("tie_word_embeddings", bool, None),
        quantization=_quantization(field("quantization", dict, None) or _microscaling(raw), source),
        eos_token_ids=_eos_ids(raw, generation or {}, field("vocab_size", int)),
        foreign_quantization=_foreign_quantization(raw),
    )
    return ModelConfig(**{**common, **family.read_config(fields)})


def read_sliding_layers(fields: ConfigFields) -> list[bool] | None:
    """Which layers attend through a sliding window, from `layer_types` (as transformers
    writes it: one "sliding_attention" or "full_attention" per layer); None without it."""
    num_layers = fields.get("num_hidden_layers", int)
    layer_types = fields.get("layer_types", list, None)
    if layer_types is None:
        return None
    kinds = ("sliding_attention", "full_attention")
    if len(layer_types) != num_layers or not all(kind in kinds for kind in layer_types):
        raise CheckpointError(
            f"{fields.source}: layer_types needs {num_layers} entries of "
            "'sliding_attention' or 'full_attention'"
        )
    return [kind == "sliding_attention" for kind in layer_types]


def _check_full_rotation(fields: ConfigFields, rope_scaling: dict[str, Any] | None, family_rotates_part: bool) -> None:
    """A `partial_rotary_factor` under 1 where the family rotates whole heads (all but
    phi3's, glm4's and Gemma 4's): transformers rotates that share of each head, and run whole
    every token was off, with no error."""
    if family_rotates_part:
        return
    for where, value in (
        ("partial_rotary_factor", fields.raw.get("partial_rotary_factor")),
        ("rope_parameters.partial_rotary_factor", (fields.raw.get("rope_parameters") or {}).get("partial_rotary_factor")),
        ("rope_scaling.partial_rotary_factor", (rope_scaling or {}).get("partial_rotary_factor")),
    ):
        if value is not None and value != 1:
            raise CheckpointError(
                f"{fields.source}: {where} {value!r} is not supported for model_type "
                f"'{fields.raw['model_type']}' (it rotates whole heads; phi3, glm4 and Gemma 4 rotate part)"
            )


def rope_fields(fields: ConfigFields) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling). transformers 5 writes neither: both go under
    `rope_parameters` (`{"rope_theta": 500000.0, "rope_type": "llama3", "factor": ...}`),
    and reading only the old names ran such a Llama or Qwen at theta 10,000, unscaled,
    with no error. Gemma 3's per-layer-type form is its own file's to read."""
    rope_theta = fields.get("rope_theta", float, None)
    rope_scaling = fields.get("rope_scaling", dict, None)
    parameters = fields.get("rope_parameters", dict, None) or {}
    if not any(isinstance(value, dict) for value in parameters.values()):
        if rope_theta is None and "rope_theta" in parameters:
            nested = ConfigFields(parameters, f"{fields.source}: rope_parameters")
            rope_theta = nested.get("rope_theta", float)
        # Some write only the older "type" (Ministral 3's transformers defaults).
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_scaling is None and kind != "default":
            rope_scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return (10000.0 if rope_theta is None else rope_theta), rope_scaling


# A Hugging Face quantization_config whose packing is one of mlx's own (gpt-oss's
# experts as OpenAI released them), as mlx-lm reads it: quant_method -> `quantization`.
MICROSCALING_METHODS = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}


def _microscaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The MLX `quantization` a quantization_config of an mlx packing amounts to, if any."""
    quant = raw.get("quantization_config")
    if "quantization" in raw or not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    return MICROSCALING_METHODS.get(method) if isinstance(method, str) else None


def _foreign_quantization(raw: dict[str, Any]) -> str | None:
    """The quant_method of a Hugging Face quantization_config, unless an MLX
    `quantization` says how the weights are stored (mlx-community writes both) or
    the method is one of mlx's packings."""
    quant = raw.get("quantization_config")
    if "quantization" in raw or not isinstance(quant, dict) or _microscaling(raw) is not None:
        return None
    method = quant.get("quant_method")
    return method if isinstance(method, str) and method else "unknown"


def _quantization(quant: dict[str, Any] | None, source: str) -> Quantization | None:
    if quant is None:
        return None
    group_size, bits, mode = quant.get("group_size"), quant.get("bits"), quant.get("mode", "affine")
    if not (_is_positive_int(group_size) and _is_positive_int(bits)):
        raise CheckpointError(
            f"{source}: field 'quantization' needs positive integer group_size and bits, "
            f"got group_size={group_size!r}, bits={bits!r}"
        )
    _check_mode(mode, source)
    per_layer: dict[str, tuple[int | None, int | None, str]] = {}
    for path, spec in quant.items():
        if not isinstance(spec, dict):
            continue  # the defaults above, or a layer marked unquantized (false)
        # As mlx-lm passes such an entry to mlx's to_quantized: a mode that is absent is
        # affine, whatever the checkpoint's own (mlx-lm's MoE recipes write 8-bit
        # entries without one in mxfp4 checkpoints), and a group_size or bits that is
        # null or absent is that mode's default (its mixed recipes write group_size null).
        layer_group, layer_bits = spec.get("group_size"), spec.get("bits")
        layer_mode = spec.get("mode", "affine")
        if not all(v is None or _is_positive_int(v) for v in (layer_group, layer_bits)):
            raise CheckpointError(
                f"{source}: quantization entry {path!r} needs positive integer group_size "
                f"and bits, got {spec!r}"
            )
        _check_mode(layer_mode, source)
        per_layer[path] = (layer_group, layer_bits, layer_mode)
    return Quantization(group_size, bits, per_layer, mode)


def _is_positive_int(value: Any) -> TypeGuard[int]:
    # mlx divides by the group size unchecked: a 0 killed the process (SIGFPE).
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_mode(mode: Any, source: str) -> None:
    if mode not in QUANTIZATION_MODES:
        raise CheckpointError(
            f"{source}: quantization mode {mode!r} is not supported "
            f"(supported: {', '.join(QUANTIZATION_MODES)})"
        )


# What llama3 RoPE scaling takes for a field its config leaves out (as transformers).
LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def is_positive_number(value: object) -> TypeGuard[int | float]:
    """A finite number above 0, not a boolean: what a scaling may divide by."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _check_rope_scaling(kind: str, scaling: dict[str, Any], source: str) -> None:
    """The numbers a scaling divides by or multiplies with must be positive, and llama3's
    high_freq_factor above its low one (RoPE divides by their difference)."""
    if kind == "default":
        return

    def positive(name: str, default: float | None = None) -> float:
        value = scaling.get(name, default)
        if not is_positive_number(value):
            raise CheckpointError(
                f"{source}: rope_scaling {kind} needs a positive number '{name}', got {value!r}"
            )
        return float(value)

    positive("factor")
    if kind == "llama3":
        low, high, _ = (positive(name, default) for name, default in LLAMA3_ROPE_DEFAULTS.items())
        if high <= low:
            raise CheckpointError(
                f"{source}: rope_scaling llama3 needs high_freq_factor above low_freq_factor, "
                f"got {high:g} and {low:g}"
            )


def _complete_yarn(scaling: dict[str, Any], base: float, context: int, source: str) -> dict[str, Any]:
    """YaRN's settings, checked, with what transformers derives for those left out: the
    original context is max_position_embeddings, and `factor` is the ratio of the two
    where only the original context is given."""
    scaling = dict(scaling)
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = context
    if scaling.get("factor") is None and is_positive_number(scaling["original_max_position_embeddings"]):
        scaling["factor"] = context / scaling["original_max_position_embeddings"]
    for name in ("factor", "original_max_position_embeddings"):  # factor is left out where it was not derived
        if not is_positive_number(scaling.get(name)):
            raise CheckpointError(
                f"{source}: rope_scaling yarn needs a positive number '{name}', got {scaling.get(name)!r}"
            )
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        value = scaling.get(name)
        if value is not None and not (is_positive_number(value) or value == 0):
            raise CheckpointError(f"{source}: rope_scaling yarn's '{name}' must be a number of at least 0, got {value!r}")
    if scaling.get("attention_factor") == 0:
        raise CheckpointError(f"{source}: rope_scaling yarn's 'attention_factor' must be above 0")
    if not (is_positive_number(base) and base != 1.0):  # its ramp divides by log(rope_theta)
        raise CheckpointError(f"{source}: rope_scaling yarn needs a rope_theta above 0 other than 1, got {base!r}")
    return scaling


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids both files name; one that is no token of the vocabulary
    (past it, negative, a boolean) is none: kept, it made llguidance refuse every
    structured-output request, as a GGUF's did."""
    ids: list[int] = []
    for source in (generation, raw):
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if is_token_id(item, vocab_size) and item not in ids:
                ids.append(item)
    return tuple(ids)


def is_token_id(value: object, vocab_size: int) -> TypeGuard[int]:
    """An id of the vocabulary: an int (not a bool) in [0, vocab_size)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not is_present(path):
        if required:
            raise CheckpointError(f"{path}: file not found")
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
