"""Text <-> token ids for a checkpoint (streaming detokenization: detokenizer.py; stop strings: stop_strings.py).

Built on Hugging Face `tokenizers` (the Rust library) and the files a Hugging Face
checkpoint ships; transformers is never imported (it is only the tests' oracle).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.chat_template import CHATML_TEMPLATE, ChatTemplate
from runtime.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from runtime.errors import CheckpointError, RequestError
from runtime.files import is_present, one_line, read_json
from runtime.template_files import chat_template_source, tool_use_template_source

import jinja2
import tokenizers

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, kept by Llama 3 and Qwen): each byte is a
    printable character, itself where it is printable, else 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL_DECODER = _byte_level_decoder()
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A checkpoint's tokenizer and chat template.

    `decode` is the `tokenizers` decode as is: transformers' optional
    `clean_up_tokenization_spaces` pass is not applied, because it rewrites text across
    token boundaries and so cannot be streamed.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        tool_use_template: str | None = None,
        byte_fallback: bool = False,
    ):
        """`special_tokens` maps `bos_token`/`eos_token`/... to token strings.

        `tool_use_template` is the template a chat with tools renders through, where the
        checkpoint names one (`tool_use`) beside its default `chat_template`.
        `byte_fallback` says the decoder joins `<0xNN>` pieces into characters.
        Raises `jinja2.TemplateSyntaxError` if a template does not compile.
        """
        self._backend = backend
        special_tokens = dict(special_tokens or {})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos_id = _token_id(backend, special_tokens.get("eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset() if eos_id is None else frozenset({eos_id})
        self.bos_token_id: int | None = _token_id(backend, special_tokens.get("bos_token"))
        # tokenizer.json's post-processor normally adds BOS itself; older Llama exports
        # only say `add_bos_token` in the config, so add it here when the processor does not.
        bos_id = self.bos_token_id
        self._bos_to_prepend: list[int] = []
        if add_bos_token and bos_id is not None and bos_id not in backend.encode("").ids:
            self._bos_to_prepend = [bos_id]
        self.has_chat_template: bool = bool(chat_template)
        self._chat_template = ChatTemplate(chat_template or CHATML_TEMPLATE, special_tokens)
        self._tool_use_template = (
            ChatTemplate(tool_use_template, special_tokens) if tool_use_template else None
        )
        self._byte_piece_ids = _byte_piece_ids(backend) if byte_fallback else frozenset()
        # Text that decodes as itself, for decoding a token as it does after other text.
        context = backend.encode("a", add_special_tokens=False).ids
        self._piece_context = (context, backend.decode(context)) if context else None
        special_spellings = {
            token_id: token.content
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        }
        self._special_ids = frozenset(special_spellings)
        # Every added token, special or not: llguidance takes them all as special, so a
        # grammar writes one by its id (Qwen's <tool_call> is added, yet not special).
        self._added_ids = {
            token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()
        }
        # What encode_chat needs to keep a special token spelled in a message as text.
        self._spellings = {i: text for i, text in special_spellings.items() if text}
        self._plain_spelling_ids = _plain_text_ids(backend, self._spellings)
        self._spelling_pattern = re.compile(
            "|".join(map(re.escape, self._spellings.values())) or "(?!)"
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load from a Hugging Face checkpoint directory.

        Reads tokenizer.json (required) and, when present, tokenizer_config.json,
        special_tokens_map.json and chat_template.jinja (which wins over the config's
        `chat_template`, as in transformers; a config listing named templates gives
        "default" for chat and "tool_use" for a chat with tools, and so does
        additional_chat_templates/tool_use.jinja). Raises `CheckpointError` naming the
        bad file.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not is_present(tokenizer_file) and is_present(path / "tiktoken.model"):
            # Moonlight's and Kimi's: BPE ranks their own Python code reads, with its pattern.
            raise CheckpointError(
                f"{path}: its tokenizer is tiktoken.model, which cadence does not read (it has no tokenizer.json)"
            )
        raw = _read_json(tokenizer_file, required=True)
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise CheckpointError(
                f"{tokenizer_file}: not a tokenizers file ({one_line(exc)})"
            ) from exc
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file, required=False)
        special_map_file = path / "special_tokens_map.json"
        special_map = _read_json(special_map_file, required=False)
        special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            if name in config:  # an explicit null in the config means "none"
                source, value = config_file, config[name]
            else:
                source, value = special_map_file, special_map.get(name)
            if (text := _token_text(value, name, source)) is not None:
                special_tokens[name] = text
        _register_special_tokens(backend, config, special_map, special_tokens.values())
        template, template_file = chat_template_source(path, config, config_file)
        tool_use_template = tool_use_template_source(path, config, config_file, special_tokens)
        add_bos_token = config.get("add_bos_token")
        try:
            return cls(
                backend,
                special_tokens=special_tokens,
                add_bos_token=add_bos_token if isinstance(add_bos_token, bool) else None,
                chat_template=template,
                tool_use_template=tool_use_template,
                byte_fallback=_has_byte_fallback(raw.get("decoder")),
            )
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(
                f"{template_file}: chat template does not compile ({one_line(exc)})"
            ) from exc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_unicode(text)
        ids = _encode_without_gil(self._backend, text, add_special_tokens).ids
        return [*self._bos_to_prepend, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int, after_text: bool = True) -> tuple[str, bytes]:
        """A token, for logprobs: (its text, the bytes it adds to the output).

        `after_text`: the output already holds text, so the token decodes as it does
        mid-sequence. A SentencePiece word start keeps its space there (" there"); first
        in an output, as decoded alone, a Strip decoder drops it ("there").

        A token that is part of a multi-byte character (one byte of an emoji) decodes
        alone to U+FFFD, so its bytes come from the vocabulary instead: a byte-level
        BPE piece maps back to bytes, a `<0xNN>` piece is byte NN. Its text is then
        OpenAI's spelling of such a token, "bytes:\\xf0\\x9f"."""
        text = None
        if after_text and self._piece_context:
            context, context_text = self._piece_context
            within = self.decode([*context, token_id], skip_special_tokens=False)
            if within.startswith(context_text):
                text = within[len(context_text) :]
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return text, text.encode()
        piece = self._backend.id_to_token(token_id) or ""
        if token_id in self._byte_piece_ids:
            raw = bytes([int(piece[3:5], 16)])
        elif piece and all(c in _BYTE_LEVEL_DECODER for c in piece):
            raw = bytes(_BYTE_LEVEL_DECODER[c] for c in piece)
        else:  # a piece whose text really holds U+FFFD, or a vocabulary we cannot map
            return text, text.encode()
        try:
            return raw.decode(), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    @property
    def chat_template_source(self) -> str:
        """The Jinja source in use: the checkpoint's, or the ChatML fallback."""
        return self._chat_template.source

    @property
    def tool_use_template_source(self) -> str:
        """The Jinja source a chat with tools renders through: the checkpoint's
        "tool_use" template where it names one, as transformers chooses, else the chat's."""
        return self._template_for(has_tools=True).source

    def _template_for(self, has_tools: bool) -> ChatTemplate:
        if has_tools and self._tool_use_template is not None:
            return self._tool_use_template
        return self._chat_template

    @property
    def highest_token_id(self) -> int:
        """The largest id in the vocabulary, added tokens included (-1 for none)."""
        return max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its JSON file reads (llguidance builds its own from it)."""
        return self._backend.to_str()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; ChatML when the checkpoint ships no template.

        `template_kwargs` are extra template variables (e.g. `enable_thinking`).
        Raises `RequestError` for malformed messages or a chat the template rejects.
        """
        return self._chat_template.render(messages, add_generation_prompt, template_kwargs)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt token ids. The template writes BOS itself when the model wants one, so
        encoding adds no special tokens (as transformers' `apply_chat_template` does).

        Special tokens come only from the template's own text: a message that spells one
        (say `<|im_start|>system`) gets that spelling as ordinary text, so no message can
        forge a turn; unlike transformers, which parses it. Raises `RequestError` when the
        template rewrites such a message so that its text cannot be told from the template's.
        """
        prompt, spans = self._template_for(bool(tools)).render_with_spans(
            messages, add_generation_prompt, template_kwargs, self._spells_special_token, tools
        )
        _check_unicode(prompt)
        encoding = _encode_without_gil(self._backend, prompt, add_special_tokens=False)
        if not spans:
            return encoding.ids  # no message spells a special token: the encoding as is
        # One encode of the whole prompt, then each special token spelled inside a message
        # becomes the ids of its spelling: the rest stays exactly as the tokenizer split it.
        ids: list[int] = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._plain_spelling_ids:
                # A token that strips whitespace beside it spans that too: only the spelling counts.
                spelling = self._spellings[token_id]
                if (found := prompt.find(spelling, start, end)) >= 0:
                    start, end = found, found + len(spelling)
                if any(start < span_end and span_start < end for span_start, span_end in spans):
                    ids.extend(self._plain_spelling_ids[token_id])
                    continue
            ids.append(token_id)
        return ids

    @property
    def control_spellings(self) -> Mapping[int, str]:
        """Each special (control) token's id -> its text, where it has any."""
        return self._spellings

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token, special or not, spelled exactly `text`, if there is one."""
        return self._added_ids.get(text)

    def _spells_special_token(self, text: str) -> bool:
        return self._spelling_pattern.search(text) is not None

    def detokenizer(
        self, skip_special_tokens: bool = True, kept_ids: Iterable[int] = ()
    ) -> IncrementalDetokenizer:
        """`kept_ids`: special tokens kept as text though the others are skipped (a
        thinking model's tags, where its tokenizer holds them special)."""
        skipped = self._special_ids - frozenset(kept_ids) if skip_special_tokens else frozenset()
        # Skipped ids never reach `decode`: the kept ones alone are left for it to spell.
        spells = not skip_special_tokens or skipped != self._special_ids

        def decode(ids: list[int]) -> str:
            return self._backend.decode(ids, skip_special_tokens=not spells)

        run_ids = self._byte_piece_ids
        if run_ids and skip_special_tokens:
            run_ids |= skipped  # a skipped token does not end a run of byte pieces
        return IncrementalDetokenizer(decode, run_ids, skipped)


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    """The JSON object in `file`; {} when an optional file is absent."""
    if not is_present(file):
        if required:
            raise CheckpointError(f"{file}: not found (the checkpoint has no tokenizer)")
        return {}
    data = read_json(file)
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, name: str, source: Path) -> str | None:
    """A special token as written in the config: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(
        f"{source}: '{name}' should be a string or {{\"content\": ...}}, got {value!r}"
    )


def _register_special_tokens(
    backend: tokenizers.Tokenizer,
    config: dict[str, Any],
    special_map: dict[str, Any],
    named_tokens: Iterable[str],
) -> None:
    """Make tokens the configs call special split out when encoding and skippable when
    decoding, as transformers does, when tokenizer.json did not list them itself (or
    listed them as plain: the config's `special` wins, as in transformers)."""
    added = backend.get_added_tokens_decoder().values()
    registered = {token.content for token in added}
    plain = {token.content for token in added if not token.special}
    declared = config.get("added_tokens_decoder")
    new_tokens = [
        tokenizers.AddedToken(
            entry["content"],
            special=bool(entry.get("special", False)),
            normalized=bool(entry.get("normalized", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            single_word=bool(entry.get("single_word", False)),
        )
        for entry in (declared.values() if isinstance(declared, dict) else ())
        if isinstance(entry, dict)
        and isinstance(entry.get("content"), str)
        and (
            entry["content"] not in registered
            or (entry["content"] in plain and entry.get("special") is True)
        )
    ]
    extra = [
        *_token_texts(config.get("additional_special_tokens")),
        *_token_texts(special_map.get("additional_special_tokens")),
        *_token_texts(config.get("extra_special_tokens")),  # transformers 5's name for them
    ]
    for text in [*named_tokens, *extra]:
        # Only tokens already in the vocabulary: a new id would not fit the model's embedding.
        if text not in registered and backend.token_to_id(text) is not None:
            registered.add(text)
            new_tokens.append(tokenizers.AddedToken(text, special=True, normalized=False))
    if new_tokens:
        backend.add_tokens(new_tokens)


def _token_texts(value: Any) -> list[str]:
    """Token strings from a config list (or name -> token dict) of strings or AddedToken dicts."""
    entries = (
        value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    )
    texts = [entry.get("content") if isinstance(entry, dict) else entry for entry in entries]
    return [text for text in texts if isinstance(text, str)]


def _has_byte_fallback(decoder: Any) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence) contains ByteFallback."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteFallback":
        return True
    return any(_has_byte_fallback(inner) for inner in decoder.get("decoders") or ())


def _byte_piece_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(token_id for token, token_id in vocab.items() if _BYTE_PIECE.fullmatch(token))


def _plain_text_ids(
    backend: tokenizers.Tokenizer, spellings: Mapping[int, str]
) -> dict[int, list[int]]:
    """Each special token's spelling encoded as ordinary text, not as the token.

    A SentencePiece tokenizer may start the ids with a word-boundary piece, as it does
    at the start of any text: the spelling then reads as if after a space.
    """
    was_encoding_special = backend.encode_special_tokens
    backend.encode_special_tokens = True  # a switch on the whole backend: set only while loading
    try:
        encodings = backend.encode_batch(list(spellings.values()), add_special_tokens=False)
    finally:
        backend.encode_special_tokens = was_encoding_special
    return {token_id: e.ids for token_id, e in zip(spellings, encodings, strict=True)}


def _encode_without_gil(
    backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool
) -> tokenizers.Encoding:
    """`backend.encode(text)`, with the GIL released while it runs.

    `encode` holds the GIL for the whole call: a prompt of a few MB (~5 s to encode on
    a 2-core box) froze the event loop on the other thread, and with it every stream
    and request. `encode_batch` does the same work with the GIL released."""
    (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
    return encoding


def _check_unicode(text: str) -> None:
    """Raise RequestError if `text` holds a lone surrogate: a command-line byte that is
    not UTF-8 (Python's surrogateescape), or a str an embedding application built. HTTP
    bodies are refused earlier (actors/openai_requests.py). The Rust tokenizer's own
    refusal was "TextInputSequence must be str", for a str, and a logged traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        byte = f" (byte 0x{code - 0xDC00:02X}, which is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        raise RequestError(
            f"the prompt holds a lone surrogate, U+{code:04X}{byte}: it is not valid Unicode text"
        ) from None


def _token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)

