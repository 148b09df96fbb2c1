"""Train the demo tokenizer and model shipped in `runtime/demo/`.

The corpus is CPython's own help text (`pydoc_data.topics`, in the stdlib, so this
runs offline). It writes a byte-level BPE tokenizer with ChatML special tokens, then
trains a small llama on the raw topics plus ChatML turns built from their sections
("Tell me about the "for" statement." -> the section text), so both completions and
chat produce doc-like English. The default sizes train in about 10 minutes on 2 CPU
cores. The text differs between Python versions; the shipped demo used 3.11.

    python examples/train_demo.py                # writes runtime/demo/
    python examples/train_demo.py --measure 5    # time a few steps, write nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

# Threaded OpenBLAS made small batched matmuls ~100x slower when another process
# shared the 2 cores (1 s vs 5 ms for the attention scores); one thread is steady.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# cadence's CPU kernels serve inference: their primitives have no gradient, and the
# first step raised "[Primitive::vjp] Not implemented for CadenceRmsNorm". Training
# runs mlx's own ops (below, the MLP activations too: their polynomial exp has none).
os.environ["CADENCE_CPU_KERNELS"] = "off"

from runtime.config import config_from_dict
from runtime.models import build_model, layers
from runtime.models.layers import CausalLM
from runtime.synth import (
    DEMO_DIR,
    SPECIAL_TOKENS,
    eos_ids,
    generation_config,
    hf_config,
    save_weights,
    write_json,
)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kernels.swiglu import reference_gelu_tanh, reference_swiglu

layers.swiglu, layers.gelu_tanh = reference_swiglu, reference_gelu_tanh

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QUESTIONS = (
    "Tell me about {}.",
    "What is {}?",
    "Explain {}.",
    "Can you describe {}?",
    "What does the Python documentation say about {}?",
)
HEADING = re.compile(r"^(\S[^\n]*)\n([*=\-~^])\2+\n", re.M)
MODEL_SHAPE = dict(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688
)


def chat(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) for every underlined heading in a topic's text."""
    found = [m for m in HEADING.finditer(text) if len(m.group(0).split("\n")[1]) == len(m[1])]
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [(m[1], text[m.end() : end].strip("\n")) for m, end in zip(found, ends, strict=True)]


def first_paragraphs(body: str, max_chars: int) -> str:
    """Whole paragraphs from the start of `body`, at least one, up to `max_chars`."""
    kept: list[str] = []
    for para in body.split("\n\n"):
        if kept and sum(len(p) + 2 for p in kept) + len(para) > max_chars:
            break
        kept.append(para)
    return "\n\n".join(kept)[: max_chars * 2]


def build_documents(rng: random.Random) -> list[str]:
    """Raw topics and ChatML conversations, each ending in `<|endoftext|>`, shuffled."""
    docs = [topics[key] for key in sorted(topics)]
    seen = set()
    for key in sorted(topics):
        for title, body in sections(topics[key]):
            if title in seen or len(body) < 80:
                continue
            seen.add(title)
            subject = "the " + title[4:] if title.startswith("The ") else title
            answer = first_paragraphs(body, 300)
            for question in rng.sample(QUESTIONS, 3):
                docs.append(chat(question.format(subject), answer))
    rng.shuffle(docs)
    return [doc + "<|endoftext|>" for doc in docs]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sorted(set(docs)), trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",  # chat turns end here; generation_config adds <|endoftext|>
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(tokenizer_config, indent=2) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


def split_stream(ids: list[int], block: int, every: int) -> tuple[mx.array, mx.array]:
    """Hold out every `every`-th block of `block` tokens for validation."""
    train, val = [], []
    for i, start in enumerate(range(0, len(ids), block)):
        (val if i % every == every - 1 else train).extend(ids[start : start + block])
    return mx.array(train, dtype=mx.int32), mx.array(val, dtype=mx.int32)


def init_weights(model: CausalLM, seed: int) -> None:
    """GPT-2 style: N(0, 0.02), residual outputs scaled by depth, norms at 1."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    residual_std = 0.02 / math.sqrt(2 * model.config.num_hidden_layers)
    new = []
    for key, (name, p) in zip(keys, params, strict=True):
        if "norm" in name:
            new.append((name, mx.ones_like(p)))
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        new.append((name, std * mx.random.normal(p.shape, key=key)))
    model.load_weights(new)


def loss_fn(model: CausalLM, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def greedy(
    model: CausalLM, tokenizer: Tokenizer, prompt: str, max_tokens: int, stop: set[int]
) -> str:
    ids = tokenizer.encode(prompt).ids
    new: list[int] = []
    for _ in range(max_tokens):
        logits = model(mx.array([ids + new], dtype=mx.int32))[0, -1]
        token = int(mx.argmax(logits).item())
        if token in stop:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    parser.add_argument("--steps", type=int, default=720)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", type=int, default=0, help="time N steps, write nothing")
    args = parser.parse_args()
    mx.random.seed(args.seed)
    rng = random.Random(args.seed)

    docs = build_documents(rng)
    tokenizer = train_tokenizer(docs, args.vocab_size)
    ids = [i for doc in docs for i in tokenizer.encode(doc).ids]
    train_ids, val_ids = split_stream(ids, block=1024, every=20)
    print(f"{len(docs)} documents, {len(ids)} tokens ({val_ids.size} held out)")

    raw = hf_config(
        "llama",
        vocab_size=tokenizer.get_vocab_size(),
        eos_token_id=eos_ids(tokenizer),
        dtype="float16",
        **MODEL_SHAPE,
    )
    model = build_model(config_from_dict(raw))
    init_weights(model, args.seed)
    num_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    print(f"model: {num_params / 1e6:.2f}M parameters")

    warmup = min(100, args.steps // 10)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, args.lr, warmup),
            optim.cosine_decay(args.lr, args.steps - warmup, end=args.lr * 0.05),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.05)
    state = [model.state, optimizer.state]

    def step(batch: mx.array) -> mx.array:
        loss, grads = nn.value_and_grad(model, loss_fn)(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    # Compiled with the model and optimizer state captured, so a step is one graph.
    step = mx.compile(step, inputs=state, outputs=state)
    L = args.seq_len + 1
    val_batch = mx.stack([val_ids[i : i + L] for i in range(0, val_ids.size - L, L)][:64])

    def val_loss() -> float:
        return sum(
            loss_fn(model, val_batch[i : i + 16]).item() for i in range(0, len(val_batch), 16)
        ) / math.ceil(len(val_batch) / 16)

    num_steps = args.measure or args.steps
    start = time.perf_counter()
    smoothed = None
    for i in range(1, num_steps + 1):
        starts = mx.random.randint(0, train_ids.size - L, (args.batch_size,))
        batch = train_ids[starts[:, None] + mx.arange(L)]  # [B, L]
        loss = step(batch)
        mx.eval(state, loss)
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if i % 50 == 0 or i == num_steps or args.measure:
            elapsed = time.perf_counter() - start
            print(f"step {i:5d}  loss {smoothed:.3f}  {elapsed / i * 1000:.0f} ms/step", flush=True)
        if i % max(1, num_steps // 3) == 0 and i < num_steps:
            print(f"step {i:5d}  val loss {val_loss():.3f}", flush=True)
    if args.measure:
        return

    final_train, final_val = smoothed, val_loss()
    print(f"final: train loss {final_train:.3f}  val loss {final_val:.3f}")
    stop = set(eos_ids(tokenizer))
    chat_prompt = '<|im_start|>user\nTell me about the "while" statement.<|im_end|>\n'
    for prompt in ("The for statement", chat_prompt + "<|im_start|>assistant\n"):
        print(f"--- {prompt!r}\n{greedy(model, tokenizer, prompt, 80, stop)}")

    # Every file is written beside the checkpoint first and moved in at the end: the
    # tokenizer written at the start, then a Ctrl-C during training, left the shipped
    # demo with a new tokenizer over the old weights (its text silently lost tokens).
    args.out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        write_tokenizer(tokenizer, staging)
        write_json(staging / "config.json", raw)
        write_json(staging / "generation_config.json", generation_config(raw["eos_token_id"]))
        weights = {name: p.astype(mx.float16) for name, p in tree_flatten(model.parameters())}
        save_weights(staging, weights)
        for file in staging.iterdir():
            os.replace(file, args.out / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
