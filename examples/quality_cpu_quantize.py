"""What `--cpu-quantize 8|4` costs in quality, on the shipped demo model (a trained fp16 llama).

    python examples/quality_cpu_quantize.py [--model PATH] [--new-tokens 48]

Loads the checkpoint four ways on the CPU (expanded to float32; its 16-bit weights kept,
computed in float32, the default; quantized to 8 and to 4 bits at load, group 64, run by
cadence's kernels) and prints, against float32:
  - perplexity on a fixed text (CPython's help for the `for` statement, from the stdlib);
  - greedy agreement: over 8 prompts, the share of generated tokens equal to float32's
    at the same position, and how many of the 8 continuations are identical.
The forward runs without a KV cache (the whole sequence each step): a quality check, not
a speed one.
"""

from __future__ import annotations

import argparse
import math
from pydoc_data.topics import topics

import runtime  # noqa: F401  (loads the optimized BLAS before mlx)
from runtime.checkpoint import load_model

import mlx.core as mx

PROMPTS = ["The for statement", "A class definition", "def f(x):", "Exceptions are",
           "import sys", "The while loop", "Dictionaries map", "Strings can be"]


def perplexity(model, tokens: list[int]) -> float:
    logits = model(mx.array([tokens])).astype(mx.float32)[0, :-1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens[1:])[:, None], axis=-1)
    return math.exp(-mx.mean(chosen).item())


def greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo)")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    results = {}
    for setting in ("float32", "off", "8", "4"):
        loaded = load_model(args.model, cpu_quantize=setting)
        text = loaded.tokenizer.encode(topics["for"])[:512]
        prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
        results[setting] = (
            perplexity(loaded.model, text),
            [greedy(loaded.model, p, args.new_tokens) for p in prompts],
        )
    base_ppl, base_runs = results["float32"]
    print(f"model: {args.model or 'the demo'}; text: {len(text)} tokens; "
          f"{len(PROMPTS)} prompts x {args.new_tokens} greedy tokens")
    print("| weights | perplexity | vs float32 | tokens equal to float32's | identical continuations |")
    print("|---|---|---|---|---|")
    for setting, (ppl, runs) in results.items():
        equal = sum(a == b for run, base in zip(runs, base_runs, strict=True) for a, b in zip(run, base, strict=True))
        total = sum(len(run) for run in runs)
        same = sum(run == base for run, base in zip(runs, base_runs, strict=True))
        name = {"float32": "float32", "off": "16-bit storage (default)"}.get(setting, f"{setting}-bit at load")
        print(f"| {name} | {ppl:.3f} | {ppl / base_ppl:.4f}x | {equal / total:.1%} | {same}/{len(runs)} |")


if __name__ == "__main__":
    main()
