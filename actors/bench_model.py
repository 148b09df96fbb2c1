"""The benchmark checkpoint, and the compute floor a burst of tokens cannot beat.

The checkpoint is examples/bench_engine.py's: ~200M parameters, fp32, random
weights, Llama-shaped (hidden 1024, 16 layers, 16 heads, 4 KV heads, FFN 2816,
tied embeddings), built once and cached. Serving benchmarks cut its vocabulary to
the demo tokenizer's 2048 tokens, so every sampled token is text.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import struct
import time
from pathlib import Path
from typing import Any, TypeGuard

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.checkpoint import DEMO_CHECKPOINT
from runtime.config import config_from_dict
from runtime.errors import CadenceError, CheckpointError
from runtime.files import check_regular, one_line, read_json
from runtime.models import build_model

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten

from kernels.blas import active_blas
from kernels.cpu_extension import kernel_status

BENCH_CONFIG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,  # RoPE needs no weights: long-prompt benches fit
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
SERVING_VOCAB = 2048  # the demo tokenizer's


def bench_checkpoint(root: Path, vocab_size: int = SERVING_VOCAB) -> Path:
    """The benchmark checkpoint under `root`, built on first use (about 0.7-0.9 GB).

    Built in a directory of its own and renamed into place when whole: a build cut
    short (a full disk, a Ctrl-C) left a truncated checkpoint that every later run took
    as built. One without its tokenizer files (copied last) is such a leftover."""
    config = {**BENCH_CONFIG, "vocab_size": vocab_size}
    suffix = "" if vocab_size == BENCH_CONFIG["vocab_size"] else f"-vocab{vocab_size}"
    path = root / f"llama-200m-fp32{suffix}"
    if (path / "tokenizer_config.json").exists():
        return path
    building = root / f".{path.name}.{os.getpid()}.partial"
    try:
        building.mkdir(parents=True)
        _build(building, config)
        shutil.rmtree(path, ignore_errors=True)  # a leftover of an older, unchecked build
        os.replace(building, path)
    except (OSError, RuntimeError) as error:  # mlx's save reports a full disk as RuntimeError
        raise CadenceError(
            f"{root}: could not build the benchmark checkpoint ({one_line(error)})"
        ) from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return path


def _build(path: Path, config: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(0)
    model = build_model(config_from_dict(config))
    shapes: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {
        k: (mx.random.normal(v.shape) * (1.0 if k.endswith("norm.weight") else 0.02)).astype(
            mx.float32
        )
        + (1.0 if k.endswith("norm.weight") else 0.0)
        for k, v in shapes
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_CHECKPOINT / name, path / name)


@attrs.frozen
class Floor:
    """Compute-bound time for a burst: every token costs 2 x parameters FLOPs (one
    multiply-add per weight) at the GEMM rate measured here. It leaves out attention
    over the context, memory bandwidth (what bounds small-batch decode) and every
    overhead, so real servers sit above it."""

    num_params: int  # the weights a token multiplies through (the embedding lookup is free)
    gemm_flops: float  # FLOP/s of one fp32 matmul on this machine
    gemm_shape: tuple[int, int, int]  # [M, K] @ [K, N]

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.num_params

    def seconds(self, num_tokens: int) -> float:
        return num_tokens * self.flops_per_token / self.gemm_flops


def measure_floor(checkpoint: Path, tokens: int = 256, repeats: int = 10) -> Floor:
    """Count the checkpoint's parameters and time a prefill-chunk-sized fp32 GEMM:
    `tokens` rows through the FFN's up projection, best of `repeats`."""
    config = _config(checkpoint)
    k, n = config.get("hidden_size"), config.get("intermediate_size")
    # The timed matrix is k x n floats: past 2**30 (4 GB; the largest open models are
    # under 2**30) a garbage config would take the memory.
    if not (_is_size(k) and _is_size(n) and k * n <= 1 << 30):
        raise CheckpointError(
            f"{checkpoint}/config.json: hidden_size and intermediate_size must be positive "
            f"integers whose product is at most 2**30, got {k!r} and {n!r}"
        )
    a = mx.random.normal((tokens, k)).astype(mx.float32)
    b = mx.random.normal((k, n)).astype(mx.float32)
    mx.eval(a, b)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return Floor(count_parameters(checkpoint), 2.0 * tokens * k * n / best, (tokens, k, n))


def count_parameters(checkpoint: Path) -> int:
    """Weights a token's forward multiplies, from the safetensors headers: quantized
    weights count their unpacked size; an untied embedding table is left out, and so is
    Gemma 4's per-layer one (a lookup too); routed experts (qwen3_moe, qwen2_moe, mixtral,
    gpt_oss, gemma4, the DeepSeek-style ones) count the share a token runs, top k of E."""
    config = _config(checkpoint)
    quantization = config.get("quantization")
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    shapes: dict[str, tuple[str, int]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        try:
            for name, info in _header(file).items():
                if name != "__metadata__":
                    numel = 1
                    for dim in info["shape"]:
                        numel *= int(dim)
                    shapes[name] = (str(info["dtype"]), numel)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{file}: not a safetensors file (a malformed header)") from None
    counted = {
        name: numel * 32 // bits if dtype == "U32" and bits else numel
        for name, (dtype, numel) in shapes.items()
        # quantization metadata beside a packed weight multiplies nothing
        if not (
            name.endswith((".scales", ".biases")) and f"{name.rsplit('.', 1)[0]}.weight" in shapes
        )
    }
    # DeepSeek's configs (deepseek_v2, deepseek_v3, glm4_moe_lite, glm4_moe) say n_routed_experts.
    num_experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    top_k = config.get("num_experts_per_tok", config.get("top_k_experts"))  # Gemma 4's name
    if _is_size(num_experts) and _is_size(top_k):
        counted = {
            name: n * top_k // num_experts if (".switch_mlp." in name or ".experts." in name) else n
            for name, n in counted.items()
        }
    counted = {name: n for name, n in counted.items() if not name.endswith("embed_tokens_per_layer.weight")}
    if any(name.endswith("lm_head.weight") for name in counted):
        return sum(n for name, n in counted.items() if not name.endswith("embed_tokens.weight"))
    return sum(counted.values())


def _is_size(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _config(checkpoint: Path) -> dict[str, Any]:
    """config.json's object; a CheckpointError for a directory without one (or a GGUF
    file, a Hub id: the floor reads a checkpoint directory) or a malformed one."""
    if not checkpoint.is_dir():
        what = "not a directory" if checkpoint.exists() else "no such directory"
        raise CheckpointError(
            f"{checkpoint}: {what}: the compute floor reads a local checkpoint directory "
            "(config.json, safetensors); for a GGUF file or a Hub id, measure a server with "
            "--url and no --checkpoint"
        )
    config = read_json(checkpoint / "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{checkpoint}/config.json: not a JSON object")
    return config


def _header(file: Path) -> Any:
    """A safetensors file's JSON header: 8 bytes of its length, then the JSON. A length
    past the file is refused before it is read (garbage took it as a size to allocate)."""
    check_regular(file)
    with file.open("rb") as f:
        start = f.read(8)
        size = struct.unpack("<Q", start)[0] if len(start) == 8 else -1
        if not 0 < size <= file.stat().st_size - 8:
            raise CheckpointError(f"{file}: not a safetensors file (a header of {size} bytes)")
        try:
            return json.loads(f.read(size))
        except (ValueError, RecursionError):
            raise CheckpointError(f"{file}: not a safetensors file (a header not JSON)") from None


def describe_machine() -> str:
    """The CPU and the kernels a figure was measured with: the same VM image has run on
    hosts with and without AVX-512, whose kernels differ by ~2x (README, Benchmarks)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs; {kernel_status()}; BLAS {active_blas()}"
