"""A `Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json, only the vocabulary with a type per token, the BPE
merges (byte-level vocabularies) or per-piece scores (SentencePiece ones), the special
token ids, the name of the pre-tokenizer (`tokenizer.ggml.pre`) and the chat template.
From those this builds the `tokenizers` pipeline that Hugging Face's own tokenizer for
the model uses, so that encode and decode give the same ids and text:

- `gpt2` (byte-level BPE: GPT-2, Llama 3, Qwen): the file's merges, with the split
  regex named by `tokenizer.ggml.pre`.
- `llama` (SentencePiece BPE with byte fallback: Llama 2, Gemma): merges recovered
  from the piece scores, as transformers recovers them from a tokenizer.model, and the
  leading-space rule from `tokenizer.ggml.add_space_prefix`.
- `gemma4` (Gemma 4): BPE over characters with the file's merges, spaces written as
  "▁", text split into runs of newlines and runs of anything else (a run that is a
  token whole stays one), byte fallback; llama.cpp always adds BOS to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.config import is_token_id
from runtime.errors import CheckpointError
from runtime.tokenizer import Tokenizer

import jinja2
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

if TYPE_CHECKING:
    from runtime.gguf_reader import Metadata

# tokenizer.ggml.token_type values (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's tekken (Mistral Nemo, Mistral Small 3, Ministral 3): a word splits where a
# capital follows a small letter ("CamelCase" -> "Camel", "Case"), with no contraction
# rule, and every digit stands alone.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# OpenAI's o200k (gpt-oss's o200k_harmony; llama.cpp's "gpt-4o", and Llama 4's): tekken's
# split by case, with contractions kept on the word and digits in threes.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _PreTokenizer(NamedTuple):
    """How one `tokenizer.ggml.pre` splits text before byte-level BPE."""

    split: str | None = None  # a split regex; None: GPT-2's own, inside ByteLevel
    is_nfc: bool = False  # Qwen's tokenizers normalize to NFC first
    ignore_merges: bool = False  # Llama 3's looks a whole word up before merging
    is_digit_split: bool = False  # SmolLM's splits every digit off first
    add_bos: bool = False  # what llama.cpp assumes where the file does not say


# Names as llama.cpp's converter writes them.
_BYTE_LEVEL_PRE: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer(),
    "gpt-2": _PreTokenizer(),
    "smollm": _PreTokenizer(is_digit_split=True),
    "llama-bpe": _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama3": _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "smaug-bpe": _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True),
    # GPT-4's cl100k (DBRX's, and Phi-4's: its files name it so); llama.cpp splits it as
    # Llama 3, merging every word.
    "dbrx": _PreTokenizer(_LLAMA3_SPLIT),
    "tekken": _PreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    "gpt-4o": _PreTokenizer(_O200K_SPLIT),
    "llama4": _PreTokenizer(_O200K_SPLIT),
    "qwen2": _PreTokenizer(_QWEN2_SPLIT, is_nfc=True),
    "deepseek-r1-qwen": _PreTokenizer(_QWEN2_SPLIT, is_nfc=True),
}


def tokenizer_from_gguf(metadata: Metadata, architecture: str) -> Tokenizer:
    """The tokenizer and chat template the file describes; `CheckpointError` if it cannot."""
    source = metadata.source
    kind = metadata.string("tokenizer.ggml.model")
    tokens = metadata.array("tokenizer.ggml.tokens", str)
    token_types = metadata.array("tokenizer.ggml.token_type", int, required=False)
    token_types = token_types or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.token_type does not match the vocabulary")
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens)
    elif kind == "llama":
        is_gemma = architecture.startswith("gemma")
        backend = _sentencepiece_bpe(metadata, tokens, token_types, is_gemma)
    elif kind == "gemma4":
        backend = _gemma4_bpe(metadata, tokens)
    else:
        raise CheckpointError(
            f"{source}: unsupported GGUF tokenizer '{kind}' (supported: gpt2, llama, gemma4)"
        )
    backend.add_tokens(
        [
            tokenizers.AddedToken(token, special=token_type == _CONTROL, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type in (_CONTROL, _USER_DEFINED)
        ]
    )
    special_tokens = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if is_token_id(token_id, len(tokens)):
            special_tokens[name] = tokens[token_id]
    # llama.cpp adds BOS to a SentencePiece vocabulary, and to Llama 3's and tekken's,
    # unless the file says otherwise.
    pre = _BYTE_LEVEL_PRE[metadata.optional("tokenizer.ggml.pre", str, "default")] if kind == "gpt2" else None
    add_bos = metadata.optional("tokenizer.ggml.add_bos_token", bool, kind == "llama" or (pre and pre.add_bos))
    add_bos = add_bos or kind == "gemma4"  # llama.cpp forces it, whatever the file says
    try:
        return Tokenizer(
            backend,
            special_tokens=special_tokens,
            add_bos_token=bool(add_bos),
            chat_template=metadata.optional("tokenizer.chat_template", str),
            # llama.cpp's converter stores a named "tool_use" template (Hermes) beside it.
            tool_use_template=metadata.optional("tokenizer.chat_template.tool_use", str),
            byte_fallback=kind in ("llama", "gemma4"),
        )
    except jinja2.TemplateSyntaxError as exc:
        reason = " ".join(str(exc).split())
        raise CheckpointError(f"{source}: chat template does not compile ({reason})") from None


def _byte_level_bpe(metadata: Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    source = metadata.source
    pre = metadata.optional("tokenizer.ggml.pre", str, "default")
    if pre not in _BYTE_LEVEL_PRE:
        supported = ", ".join(sorted(_BYTE_LEVEL_PRE))
        raise CheckpointError(
            f"{source}: unsupported GGUF pre-tokenizer '{pre}' (supported: {supported})"
        )
    spec = _BYTE_LEVEL_PRE[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = _bpe(
        metadata,
        vocab,
        _file_merges(metadata),
        ignore_merges=spec.ignore_merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    steps: list[Any] = []
    if spec.is_digit_split:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(
            pre_tokenizers.Split(tokenizers.Regex(spec.split), behavior="isolated", invert=False)
        )
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if spec.is_nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _sentencepiece_bpe(
    metadata: Metadata, tokens: list[str], token_types: list[int], is_gemma: bool
) -> tokenizers.Tokenizer:
    scores = metadata.array("tokenizer.ggml.scores", float)
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"{metadata.source}: tokenizer.ggml.scores does not match the vocabulary"
        )
    if is_gemma:
        # As transformers' GGUF loader found for Gemma files: runs of spaces are stored as
        # spaces where the tokenizer spells them "▁▁", and the merge order is the order of
        # the pieces in the file, not their scores. (Not checked against a real Gemma file.)
        tokens = [_as_metaspace(token, tokens) for token in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if is_token_id(unk_id, len(tokens)) else None
    mergeable = {
        token: score
        for token, score, token_type in zip(tokens, scores, token_types, strict=True)
        if token_type == _NORMAL
    }
    if "tokenizer.ggml.merges" in metadata:  # newer converters write them
        merges = _file_merges(metadata)
    else:
        merges = _merges_from_scores(vocab, mergeable)
    backend = _bpe(metadata, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    steps: list[Any] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.optional("tokenizer.ggml.add_space_prefix", bool, True):
        # Llama 2: a word-boundary piece before the text, even one that starts with a
        # space (as SentencePiece and llama.cpp do), dropped again when decoding.
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")  # Gemma: spaces only
    backend.decoder = decoders.Sequence(steps)
    return backend


def _gemma4_bpe(metadata: Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    """Gemma 4's tokenizer as llama.cpp runs it (its piece scores are placeholders: the
    merges order everything)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if is_token_id(unk_id, len(tokens)) else None
    backend = _bpe(
        metadata, vocab, _file_merges(metadata), unk_token=unk, fuse_unk=True, byte_fallback=True, ignore_merges=True
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _bpe(
    metadata: Metadata, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any
) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE(vocab, merges, **options))
    except Exception as exc:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        reason = " ".join(str(exc).split())
        raise CheckpointError(f"{metadata.source}: unusable BPE vocabulary ({reason})") from None


def _file_merges(metadata: Metadata) -> list[tuple[str, str]]:
    pairs = []
    for merge in metadata.array("tokenizer.ggml.merges", str):
        left, space, right = merge.partition(" ")
        if not space:
            raise CheckpointError(
                f"{metadata.source}: malformed merge {merge!r} in tokenizer.ggml.merges"
            )
        pairs.append((left, right))
    return pairs


def _as_metaspace(token: str, tokens: list[str]) -> str:
    if token and not token.strip(" ") and "\u2581" * len(token) not in tokens:
        return "\u2581" * len(token)
    return token


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two
    pieces, best-scored piece first (as transformers derives them from a tokenizer.model)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in scores and piece[i:] in scores
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
