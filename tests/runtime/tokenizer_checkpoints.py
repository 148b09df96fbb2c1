"""Tokenizer checkpoint directories for the tokenizer and detokenizer tests.

The tokenizers are trained here from CPython's own docs (`pydoc_data.topics`), so the
tests run offline, and transformers loads the same directories as the oracle. The
session fixtures `checkpoint_dirs` and `ours` (tests/runtime/conftest.py) build them once.
"""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as RustTokenizer

# Some non-ASCII text, so the vocabularies hold multi-byte characters and fragments of
# them. Hangul and emoji are left out on purpose: the SentencePiece-style tokenizers
# must spell them with byte-fallback pieces.
MULTILINGUAL = "日本語のテキストです。 Grüße aus Köln, café naïve — “quotes” 中文字符 ñandú "
CORPUS = [*list(pydoc_data.topics.topics.values())[:40], *[MULTILINGUAL] * 50]
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def write_checkpoint(out: Path, backend: RustTokenizer, config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **config,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return out


def build_byte_level(out: Path) -> Path:
    """GPT-2/Qwen style: byte-level BPE, ChatML template."""
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return write_checkpoint(
        out,
        backend,
        {
            "chat_template": CHATML_TEMPLATE,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
        },
    )


def build_llama(out: Path) -> Path:
    """Llama-2/Mistral style: BPE over `▁`-prefixed text with byte fallback, a Strip
    decoder, BOS from the post-processor, and the `[INST]` template."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    draft = RustTokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizer
    draft.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=150,
        show_progress=False,
    )
    draft.train_from_iterator(CORPUS, trainer)
    trained = json.loads(draft.to_str())["model"]
    # Byte pieces belong in the model's vocabulary (not the added tokens), as in Llama's.
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *BYTE_PIECES])}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    backend = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return write_checkpoint(
        out,
        backend,
        {
            "chat_template": LLAMA2_TEMPLATE,
            "add_bos_token": True,
            "bos_token": {
                "__type": "AddedToken",
                "content": "<s>",
                "lstrip": False,
                "special": True,
            },
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
    )


def build_metaspace_unigram(out: Path) -> Path:
    """T5/Gemma style: a Unigram model with a Metaspace pre-tokenizer and decoder and
    byte fallback; no chat template, so the ChatML fallback applies."""
    backend = RustTokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.UnigramTrainer(
        vocab_size=800,
        special_tokens=["<unk>", "<s>", "</s>", *BYTE_PIECES],
        unk_token="<unk>",
        max_piece_length=8,
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS[:20] + CORPUS[-20:], trainer)
    data = json.loads(backend.to_str())
    data["model"]["byte_fallback"] = True
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in BYTE_PIECES]
    backend = RustTokenizer.from_str(json.dumps(data))
    backend.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
    )
    return write_checkpoint(out, backend, {"eos_token": "</s>", "bos_token": "<s>"})


BUILDERS = {
    "byte_level": build_byte_level,
    "llama": build_llama,
    "metaspace": build_metaspace_unigram,
}
