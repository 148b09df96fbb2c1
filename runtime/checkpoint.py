"""Load a Hugging Face / mlx-community checkpoint into a `CausalLM`, checking every tensor.

A checkpoint is data only: config.json, *.safetensors (optionally sharded with
model.safetensors.index.json) and the tokenizer files. Nothing in it is executed.
Every failure is a `CheckpointError` whose one-line message names the file and
the tensor or field at fault; no raw mlx traceback escapes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

from runtime.config import MAX_INT_FIELD, ModelConfig, config_from_dict, is_token_id, load_config
from runtime.cpu_weights import DEFAULT_CPU_QUANTIZE, prepare_for_cpu
from runtime.environment import environment_problems
from runtime.errors import CheckpointError
from runtime.files import check_regular, is_gguf_file, is_present, one_line, read_json, shortened
from runtime.models import build_model, rename_weights
from runtime.models.layers import CausalLM
from runtime.stored_quantization import quantize_as_stored
from runtime.template_files import TOOL_USE_TEMPLATE_FILE
from runtime.tokenizer import Tokenizer

import attrs
import mlx.core as mx
import structlog
from mlx.utils import tree_flatten, tree_unflatten

DEMO_CHECKPOINT = Path(__file__).with_name("demo")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never loaded
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> shard map
# What a Hub snapshot needs: the top-level config, tokenizer and weight files, and the
# chat templates (transformers saves a named "tool_use" one in a folder). Mistral's
# repos also hold their own format's weights (consolidated.safetensors: 14.5 GB more for
# Mistral-7B-Instruct-v0.3), others keep other formats in folders (original/, onnx/);
# none of those is ever read. (fnmatch's `*` crosses folders: "*.json" alone matched
# original/params.json.)
HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "chat_template.jinja",
    TOOL_USE_TEMPLATE_FILE,
]
HUB_IGNORE_PATTERNS = ["*/*.json", "*/*.safetensors", "*/tokenizer.model", "consolidated*.safetensors"]
# safetensors' own reader refuses a longer header (the largest real ones are a few MB).
MAX_SAFETENSORS_HEADER = 100_000_000
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

log = structlog.get_logger("cadence.load")


@attrs.frozen
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    name: str  # what /v1/models reports: the repo id or directory name


def load_model(
    model: str | Path | None = None,
    *,
    offline: bool = False,
    keep_dtype: bool = False,
    cpu_quantize: str = DEFAULT_CPU_QUANTIZE,
    on_progress: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Resolve, read and check a checkpoint; None loads the built-in demo model.

    On CPU the weights take the form runtime/cpu_weights.py decides (with cadence's
    kernels built, quantized checkpoints stay quantized and 16-bit ones keep their
    linear weights in 16 bits, computed in float32; `cpu_quantize` "float32" expands
    them, "8"/"4" quantizes them at load), unless `keep_dtype`.
    On a GPU the checkpoint's dtype is kept.
    """
    progress = on_progress or (lambda message: None)
    for problem in environment_problems():
        log.warning("environment", problem=problem)
    path, name = resolve_checkpoint(model, offline=offline)
    progress(f"reading {path}")
    if is_gguf_file(path):
        # Imported here: the gguf package alone took ~0.2 s of every command's start.
        from runtime.gguf import read_gguf

        checkpoint = read_gguf(path, progress)
        config = config_from_dict(checkpoint.config, source=str(path))
        tokenizer, weights = checkpoint.tokenizer, checkpoint.weights
        del checkpoint  # its weights stay referenced by `weights` alone, dropped below
    else:
        config = load_config(path)
        tokenizer = Tokenizer.from_dir(path)
        weights = read_weights(path, progress)
    decoder = build_decoder(config, weights, source=str(path))
    # The model holds every tensor it uses now; dropping these references lets each
    # step below free a layer's stored form once its final one is built.
    del weights
    config = decoder.config  # with tie_word_embeddings decided, where config.json left it out
    try:
        decoder = prepare_for_cpu(
            decoder, keep_dtype=keep_dtype, cpu_quantize=cpu_quantize, progress=progress
        )
    except CheckpointError as error:  # weights too large for the memory: name the checkpoint
        raise CheckpointError(f"{path}: {error}") from None
    mx.eval(decoder.parameters())
    # The tokenizer's eos_token stops a reply too, as in mlx-lm and vLLM: early Llama 3
    # Instruct conversions name <|end_of_text|> in config.json and <|eot_id|> only there.
    tokenizer_eos = [
        token_id
        for token_id in sorted(tokenizer.eos_token_ids)
        if is_token_id(token_id, config.vocab_size) and token_id not in config.eos_token_ids
    ]
    if tokenizer_eos:
        config = attrs.evolve(config, eos_token_ids=(*config.eos_token_ids, *tokenizer_eos))
    return LoadedModel(model=decoder, config=config, tokenizer=tokenizer, path=path, name=name)


def resolve_checkpoint(model: str | Path | None, *, offline: bool = False) -> tuple[Path, str]:
    """A local directory or GGUF file, or a Hugging Face repo id looked up in (or fetched
    to) its cache."""
    if model is None:
        return DEMO_CHECKPOINT, "cadence-demo"
    path = Path(model).expanduser()
    text = str(model)
    try:
        if path.is_dir() or is_gguf_file(path):
            # The name as written, "." and ".." read away ("--model ." was served as ''),
            # a symlink's own name kept (not resolved).
            return path.resolve(), Path(os.path.abspath(path)).name
        exists = path.exists()
    except OSError as exc:  # a name too long, a file that cannot be read
        raise CheckpointError(f"{shortened(text)}: {one_line(exc)}") from None
    if exists:
        raise CheckpointError(f"{text}: not a checkpoint directory or a GGUF file")
    if text.endswith(".gguf"):
        raise CheckpointError(f"{text}: no such file")
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{text}: no such directory, and not a Hugging Face repo id")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            text,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            local_files_only=offline or os.environ.get("HF_HUB_OFFLINE") == "1",
        )
    except Exception as exc:  # the hub raises many kinds; all mean "not available"
        where = "in the local Hugging Face cache" if offline else "locally or on the Hub"
        raise CheckpointError(f"{text}: not found {where} ({type(exc).__name__})") from None
    return Path(local), text


def read_weights(path: Path, progress: Callable[[str], None]) -> dict[str, mx.array]:
    files, weight_map = _weight_files(path)
    weights: dict[str, mx.array] = {}
    for i, file in enumerate(files, 1):
        progress(f"loading weights {i}/{len(files)}: {file.name}")
        _check_safetensors(file)
        try:
            loaded = mx.load(str(file))
        except Exception as exc:
            reason = " ".join(str(exc).split())  # mlx quotes tensor names verbatim, newlines too
            raise CheckpointError(f"{file}: unreadable safetensors ({reason})") from None
        weights.update(loaded)  # type: ignore[arg-type]
    # An index is written from its shards' contents: a tensor it names that none holds
    # means a shard is not the one it was written with.
    if unheld := sorted(set(weight_map) - set(weights)):
        raise CheckpointError(
            f"{path / INDEX_FILE}: names tensor {unheld[0]!r} in shard "
            f"{weight_map[unheld[0]]!r}, which does not hold it (nor does any other shard)"
        )
    return {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files to read, and the index's tensor -> shard map ({} without one)."""
    if is_present(path / INDEX_FILE):
        weight_map = _read_index(path / INDEX_FILE)
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:  # Hugging Face's names first, as mlx-lm: a consolidated.safetensors beside
        # them holds the same weights in Mistral's own names
        weight_map = {}
        files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors weight files")
    for file in files:
        check_regular(file)
    return files, weight_map


def _read_index(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map, each shard in it checked to be a file
    of the checkpoint."""
    data = read_json(index)
    if not isinstance(data, dict) or "weight_map" not in data:
        raise CheckpointError(f"{index}: no weight_map (tensor names -> shard file names)")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: weight_map should map tensor names to file names")
    if not weight_map:  # was "no *.safetensors weight files", beside the shards
        raise CheckpointError(f"{index}: weight_map is empty: it names no tensor and no shard")
    for name in sorted(set(weight_map.values())):
        # Checked by name, not resolved: the Hugging Face cache links each shard to a
        # blob outside the snapshot directory.
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{index}: shard {name!r} is outside the checkpoint directory")
        if not name or Path(name) == Path("."):
            raise CheckpointError(f"{index}: names shard {name!r}, which is no file name")
        if not (index.parent / name).exists():
            raise CheckpointError(f"{index}: names shard {name!r}, which is missing")
    return weight_map


def _check_safetensors(file: Path) -> None:
    """Validate the header and length up front: mlx's own errors name neither file nor tensor."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{file}: truncated (header runs past the end of the file)")
        if header_len > MAX_SAFETENSORS_HEADER:  # read whole, it took as much memory
            raise CheckpointError(
                f"{file}: corrupt safetensors header: a header of {header_len} bytes, "
                f"more than safetensors' {MAX_SAFETENSORS_HEADER}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, a 5,000-digit integer
            raise CheckpointError(f"{file}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            if problem := _metadata_problem(info):
                raise CheckpointError(f"{file}: corrupt safetensors header: __metadata__ {problem}")
            continue
        problem = _tensor_entry_problem(info)
        if problem:
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} {problem}")
        end = info["data_offsets"][1]
        if end > data_len:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of {data_len}"
            )
    _check_tiling(file, header, data_len)


def _check_tiling(file: Path, header: dict[str, dict], data_len: int) -> None:
    """The tensors' data tiles the data section, as the safetensors format requires (its
    own reader refuses anything else): mlx reads each tensor at its offsets whatever they
    share, so a norm pointed at another's bytes loaded as that norm's weights."""
    position = 0
    spans = sorted((info["data_offsets"], name) for name, info in header.items() if name != "__metadata__")
    for (begin, end), name in spans:
        if begin != position:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensor {name!r} starts at byte {begin}, "
                f"expected {position} (tensors overlapping or leaving a gap)"
            )
        position = end
    if position != data_len:
        raise CheckpointError(
            f"{file}: corrupt safetensors header: {data_len - position} bytes after the last tensor"
        )


def _metadata_problem(metadata: object) -> str | None:
    """What mlx's reader would refuse in a header's `__metadata__`, if anything. The format
    says an object of strings; mlx writes null and also reads a string or a list of them.
    Anything else failed as mlx's "[json.exception.type_error.302] type must be string"."""
    if metadata is None or isinstance(metadata, str):
        return None
    if isinstance(metadata, dict):
        for key, value in metadata.items():
            if not isinstance(value, str):
                return f"value {key!r} is {shortened(json.dumps(value))}, not a string"
        return None
    if isinstance(metadata, list) and all(isinstance(item, str) for item in metadata):
        return None
    return f"is {shortened(json.dumps(metadata))}, not an object of strings"


def _tensor_entry_problem(info: object) -> str | None:
    """What is wrong with one tensor's header entry, if anything."""
    if not isinstance(info, dict):
        return "is not an object"
    if not isinstance(info.get("dtype"), str):
        return "has no dtype string"
    if not _naturals(info.get("shape")):
        return "has no shape of non-negative integers"
    if any(n > MAX_INT_FIELD for n in info["shape"]):  # mlx kept the low 32 bits of each
        return f"has a dimension past {MAX_INT_FIELD}"
    offsets = info.get("data_offsets")
    if not (_naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        return "has no data_offsets [begin, end]"
    return None


def _naturals(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def build_decoder(config: ModelConfig, weights: dict[str, mx.array], source: str) -> CausalLM:
    """Instantiate the model for `config` and load `weights`, checking names and shapes."""
    try:
        weights = rename_weights(config, weights)
    except CheckpointError as error:  # a fused tensor that does not split: name the file
        raise CheckpointError(f"{source}: {error}") from None
    if config.tie_word_embeddings is None:
        # Left out, tied exactly when no lm_head is stored: mlx-lm's llama and qwen2 tie
        # by default (an lm_head stored beside was dropped: transformers, untied by
        # default, reads it), its gemma3 ties when lm_head.weight is absent; read as
        # untied, every tied checkpoint was "missing tensor 'lm_head.weight'".
        config = attrs.evolve(config, tie_word_embeddings="lm_head.weight" not in weights)
    # Building a layer costs time and memory before any shape can be checked: a layer
    # count beyond the weights' took 30 s and 5 GB at 10**6 layers to end in "missing tensor".
    stored = 1 + max(
        (int(m[1]) for name in weights if (m := _LAYER_INDEX.match(name))), default=-1
    )
    if stored != config.num_hidden_layers:
        raise CheckpointError(
            f"{source}: num_hidden_layers is {config.num_hidden_layers}, "
            f"but the weights hold {stored} layers"
        )
    try:
        decoder = build_model(config)
    except OverflowError as exc:  # sizes whose products exceed mlx's int32 shapes
        raise CheckpointError(
            f"{source}: the config's sizes are too large for mlx ({exc})"
        ) from None
    except CheckpointError as error:  # a size a layer cannot be built with: name the checkpoint
        raise CheckpointError(f"{source}: {error}") from None
    if config.tie_word_embeddings:  # a stored head is not read: its scales and biases too
        for name in [name for name in weights if name.startswith("lm_head.")]:
            del weights[name]
    if config.quantization is not None:
        quantize_as_stored(decoder, config.quantization, weights, source)
    expected = dict(tree_flatten(decoder.parameters()))
    if (problem := _weights_problem(expected, weights, config.model_type)) is not None:
        if (method := config.foreign_quantization) is not None:
            # A GPTQ/AWQ/bitsandbytes/fp8 layout fails here, on a tensor name that does
            # not say why; a stale quantization_config over float weights still loads.
            raise CheckpointError(
                f"{source}: quantized with '{method}' (config.json's quantization_config), "
                "which cadence does not load; use the float16/bfloat16 original or an "
                f"MLX-quantized conversion ({problem})"
            )
        raise CheckpointError(f"{source}: {problem}")
    decoder.update(tree_unflatten(list(weights.items())))
    return decoder


def _weights_problem(
    expected: dict[str, mx.array], weights: dict[str, mx.array], model_type: str
) -> str | None:
    """The first tensor missing, misshapen or unexpected, if any."""
    for name, param in expected.items():
        if name not in weights:
            return f"missing tensor {name!r}"
        if weights[name].shape != param.shape:
            return (
                f"tensor {name!r} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(param.shape)}"
            )
        # An integer or bool tensor where the model computes in floats (a packed
        # quantized weight is integer on both sides) loaded as numbers that mean nothing.
        if mx.issubdtype(weights[name].dtype, mx.floating) != mx.issubdtype(param.dtype, mx.floating):
            wanted = "floating-point" if mx.issubdtype(param.dtype, mx.floating) else str(param.dtype).removeprefix("mlx.core.")
            return f"tensor {name!r} has dtype {str(weights[name].dtype).removeprefix('mlx.core.')}, expected {wanted}"
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        return f"unexpected tensor {unexpected[0]!r} for {model_type}"
    return None
