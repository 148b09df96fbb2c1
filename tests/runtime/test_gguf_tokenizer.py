"""Tokenizers rebuilt from GGUF metadata encode and decode as the Hugging Face tokenizer
the file was made from: byte-level BPE vocabularies with GPT-2's, SmolLM's, Llama 3's and
Qwen 2's pre-tokenizers, and SentencePiece vocabularies with (Llama 2) and without (Gemma)
the leading word-boundary piece. transformers is the oracle, and SentencePiece itself for
Llama-style ids (see test_sentencepiece_matches_hugging_face)."""

import functools
import json
import re
import shutil
from pathlib import Path

import runtime  # noqa: F401  (the fast BLAS loads before mlx)
from runtime.errors import CheckpointError
from runtime.gguf_reader import Metadata
from runtime.gguf_synth import write_gguf
from runtime.gguf_tokenizer import tokenizer_from_gguf

import gguf
import pytest
import sentencepiece
import transformers
from gguf import GGMLQuantizationType as GGMLType
from sentencepiece import sentencepiece_model_pb2

TEXTS = [
    "Hello world",
    "  leading spaces, trailing  ",
    "numbers 1234567 and 3.14159",
    "it's we're they'll I'M",
    "Ünïcödé café naïve e\u0301",  # the last é is decomposed: NFC changes it
    "emoji 🙂🚀 and 漢字",
    "tabs\tand\nnewlines\n\n  \n",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model",
    "",
    "a zzqxv word",
    "a zzqxvZ word",  # tekken splits before the capital: the whole word " zzqxv" stays one token
    "CamelCase a/b//\n",
    "'sup y'all",  # tekken's split ("'sup") differs from Qwen 2's and Llama 3's ("'s", "up")
    'f(x) = {"a": [1, 2]} , done . ok ?!',  # a space joins the punctuation after it
]
UNMERGEABLE = "\u0120zzqxv"  # " zzqxv" in the byte-level alphabet
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there 🙂"},
]

# The split regexes as Hugging Face's Llama 3 and Qwen 2 tokenizer.json files spell them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken, as Mistral Small 3's and Ministral 3's tokenizer.json spell it.
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# OpenAI's o200k, as gpt-oss's tokenizer.json spells it.
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def split_then_bytes(pattern):
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    }


def byte_level_checkpoint(make_checkpoint, tmp_path, pre):
    """The demo checkpoint with its tokenizer.json rewritten to the `pre` family's pipeline."""
    checkpoint = tmp_path / f"checkpoint-{pre}"
    shutil.copytree(make_checkpoint("qwen2"), checkpoint)
    tokenizer_file = checkpoint / "tokenizer.json"
    raw = json.loads(tokenizer_file.read_text())
    if pre in ("llama-bpe", "tekken"):
        raw["pre_tokenizer"] = split_then_bytes(LLAMA3_SPLIT if pre == "llama-bpe" else TEKKEN_SPLIT)
        raw["model"]["ignore_merges"] = True
        # A word no merge reaches: only looking whole words up first finds it.
        vocab = raw["model"]["vocab"]
        vocab[UNMERGEABLE] = 1 + max([*vocab.values(), *(t["id"] for t in raw["added_tokens"])])
    elif pre == "smollm":
        raw["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": True,
                },
            ],
        }
    elif pre == "gpt-4o":
        raw["pre_tokenizer"] = split_then_bytes(O200K_SPLIT)
    elif pre == "qwen2":
        raw["pre_tokenizer"] = split_then_bytes(QWEN2_SPLIT)
        raw["normalizer"] = {"type": "NFC"}
    tokenizer_file.write_text(json.dumps(raw))
    return checkpoint


def hf_tokenizer(checkpoint, tmp_path):
    """transformers' tokenizer for the checkpoint's tokenizer files as they are (given
    config.json, it would build its Qwen2 pipeline instead)."""
    files = tmp_path / f"hf-{checkpoint.name}"
    files.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(checkpoint / name, files / name)
    return transformers.AutoTokenizer.from_pretrained(files)


def assert_same_as_hf(ours, hf, encode=None):
    """`encode(text, add_special_tokens)` replaces `hf.encode` as the oracle for ids."""
    encode = encode or (lambda text, add: hf.encode(text, add_special_tokens=add))
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = encode(text, add_special_tokens)
            assert ours.encode(text, add_special_tokens) == expected, text
        ids = encode(text, True)
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    expected_prompt = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == expected_prompt


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "tekken", "gpt-4o"])
def test_byte_level_bpe_matches_hugging_face(make_checkpoint, tmp_path, pre):
    checkpoint = byte_level_checkpoint(make_checkpoint, tmp_path, pre)
    path = write_gguf(
        checkpoint, tmp_path / "model.gguf", tmp_path / "reference", GGMLType.F32, pre_tokenizer=pre
    )
    hf = hf_tokenizer(checkpoint, tmp_path)
    # The tokenizer alone: llama-bpe's extra word takes an id past the embedding's rows.
    assert_same_as_hf(tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), "qwen2"), hf)


def test_a_named_tool_use_template_renders_a_chat_with_tools_as_from_the_hugging_face_files(
    make_checkpoint, tmp_path
):
    """llama.cpp's converter writes a Hermes model's templates as tokenizer.chat_template
    and tokenizer.chat_template.tool_use; a chat with tools renders through the second."""
    checkpoint = byte_level_checkpoint(make_checkpoint, tmp_path, "qwen2")
    config_file = checkpoint / "tokenizer_config.json"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    named = [
        {"name": "default", "template": plain},
        {"name": "tool_use", "template": "{{ tools | tojson }}\n" + plain},
    ]
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": named}))
    path = write_gguf(
        checkpoint, tmp_path / "model.gguf", tmp_path / "reference", pre_tokenizer="qwen2"
    )
    ours = tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), "qwen2")
    hf = hf_tokenizer(checkpoint, tmp_path)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    for tools in (None, [tool]):
        want = hf.apply_chat_template(
            CHAT, tools=tools, add_generation_prompt=True, return_dict=False
        )
        assert ours.encode_chat(CHAT, tools=tools) == want
    assert ours.tool_use_template_source == named[1]["template"]


def test_the_pre_tokenizers_really_differ(make_checkpoint, tmp_path):
    """Guards the test above: each pre-tokenizer splits some text its own way."""
    encodings = {}
    for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2", "tekken", "gpt-4o"):
        hf = hf_tokenizer(byte_level_checkpoint(make_checkpoint, tmp_path, pre), tmp_path)
        encodings[pre] = [hf.encode(text) for text in TEXTS]
    assert len({repr(e) for e in encodings.values()}) == 6


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? it's fine, we're well.",
    "Tokenizers split text into pieces: 1234 numbers, 3.14159.",
    "Unicode café naïve and some tabs\tand new lines.",
] * 40


def sentencepiece_model(tmp_path: Path, add_dummy_prefix: bool) -> Path:
    model = tmp_path / "tokenizer.model"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(model.with_suffix("")),
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,  # as Llama 2's and Gemma's models
        normalization_rule_name="identity",
        user_defined_symbols=["<start_of_turn>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model


def sentencepiece_gguf(
    model_file: Path, hf, out: Path, add_bos: bool | None = True, num_scores: int | None = None
) -> Path:
    """As llama.cpp's _create_vocab_sentencepiece: piece, score and type per id (added
    tokens typed from the Hugging Face tokenizer), plus the special ids and the flags
    (`add_bos` None: the flag left out); `num_scores` keeps only that many scores."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        tokens.append(processor.id_to_piece(i))
        scores.append(processor.get_score(i))
        if processor.IsUnknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif processor.IsControl(i):
            types.append(gguf.TokenType.CONTROL)
        elif processor.IsByte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    for token_id, added in hf.added_tokens_decoder.items():
        types[token_id] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores[:num_scores])
    writer.add_token_types(types)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(hf.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


TURNS = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_sentencepiece_matches_hugging_face(tmp_path, style):
    model_file = sentencepiece_model(tmp_path, add_dummy_prefix=style == "llama")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer" if style == "llama" else "GemmaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": None,
                "mask_token": None,
                "add_bos_token": True,
                "chat_template": TURNS,
            }
        )
    )
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    path = sentencepiece_gguf(model_file, hf, tmp_path / "spm.gguf")
    architecture = "llama" if style == "llama" else "gemma3"
    ours = tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), architecture)
    assert ours.encode("Hello")[0] == 1  # BOS
    if style == "gemma":
        assert_same_as_hf(ours, hf)
        return
    # transformers 5 converts a Llama-style tokenizer.model with a word-boundary piece
    # only when the text does not start with a space; SentencePiece itself, llama.cpp
    # and Llama 2's published tokenizer.json add it always. The ids follow those.
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def encode(text, add_special_tokens):
        # After an added token llama.cpp and Llama 2's tokenizer.json start a new word,
        # bare SentencePiece does not: such text is split and encoded piece by piece.
        ids = [1] if add_special_tokens else []
        for part in re.split("(<start_of_turn>)", text):
            ids += [3] if part == "<start_of_turn>" else processor.encode(part) if part else []
        return ids

    assert_same_as_hf(ours, hf, encode)


def sentencepiece_tokenizer(tmp_path, **options):
    """Ours for a Llama-style SentencePiece GGUF written with `sentencepiece_gguf`'s options."""
    model_file = sentencepiece_model(tmp_path, add_dummy_prefix=True)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "chat_template": TURNS})
    )
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    path = sentencepiece_gguf(model_file, hf, tmp_path / "spm.gguf", **options)
    return tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), "llama")


@pytest.mark.parametrize(("add_bos", "expected"), [(None, True), (False, False), (True, True)])
def test_a_sentencepiece_vocabulary_adds_bos_unless_the_file_says_not(
    tmp_path, add_bos, expected
):
    """As llama.cpp: a `llama` vocabulary without `add_bos_token` adds BOS."""
    ids = sentencepiece_tokenizer(tmp_path, add_bos=add_bos).encode("Hello")
    assert (ids[0] == 1) is expected and ids.count(1) == int(expected)


def test_scores_that_do_not_match_the_vocabulary_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="scores does not match the vocabulary"):
        sentencepiece_tokenizer(tmp_path, num_scores=10)


def handmade_sentencepiece(
    tmp_path: Path,
    pieces: dict[str, float],
    architecture: str = "llama",
    merges=None,
    model: str = "llama",
    has_types: bool = True,
):
    """Ours for a SentencePiece GGUF of `pieces` (piece -> score, after <unk> <s> </s>),
    with no word-boundary prefix and, if given, the file's own `merges`; `model` is the
    tokenizer.ggml.model it states, and without `has_types` it states no token types."""
    path = tmp_path / "handmade.gguf"
    tokens = ["<unk>", "<s>", "</s>", *pieces]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0, *pieces.values()])
    if has_types:
        writer.add_token_types(
            [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
            + [gguf.TokenType.NORMAL] * len(pieces)
        )
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), architecture)
    return ours, {token: i for i, token in enumerate(tokens)}


def test_a_files_own_merges_outrank_the_scores(tmp_path):
    """Newer converters write the merges: their order, not the pieces' scores, decides."""
    pieces = {"a": -5.0, "b": -5.0, "c": -5.0, "ab": -1.0, "bc": -2.0}
    by_scores, ids = handmade_sentencepiece(tmp_path, pieces)
    assert by_scores.encode("abc") == [ids["ab"], ids["c"]]
    by_merges, _ = handmade_sentencepiece(tmp_path, pieces, merges=["b c", "a b"])
    assert by_merges.encode("abc") == [ids["a"], ids["bc"]]


def test_tied_scores_merge_the_longer_left_piece_first(tmp_path):
    """Two merges of equal score compete for "c": the one whose left piece is longer
    ("ab" + "c", not "c" + "de") goes first, as transformers orders them, although
    "cde" is listed before "abc" in the vocabulary."""
    letters = {letter: -9.0 for letter in "abcde"}
    pieces = {**letters, "ab": 0.0, "de": 0.0, "cde": -1.0, "abc": -1.0}
    ours, ids = handmade_sentencepiece(tmp_path, pieces)
    assert ours.encode("abcde") == [ids["abc"], ids["de"]]


def test_gemma_runs_of_spaces_stored_as_spaces_are_word_boundary_pieces(tmp_path):
    """Gemma files store the "▁▁" piece as two spaces; text's spaces become "▁"s first,
    so only the renamed piece can match them."""
    pieces = {"\u2581": -1.0, "a": -1.0, "  ": -2.0}
    ours, ids = handmade_sentencepiece(tmp_path, pieces, architecture="gemma3")
    assert ours.encode("a  a") == [ids["a"], ids["  "], ids["a"]]
    assert ours.decode(ours.encode("a  a")) == "a  a"


def test_a_vocabulary_without_token_types_is_all_ordinary_pieces(tmp_path):
    """tokenizer.ggml.token_type is optional: without it every piece is a normal one."""
    pieces = {"a": -5.0, "b": -5.0, "ab": -1.0}
    ours, ids = handmade_sentencepiece(tmp_path, pieces, has_types=False)
    assert ours.encode("abab") == [ids["ab"], ids["ab"]]
    assert ours.decode(ours.encode("abab")) == "abab"


def test_an_unsupported_tokenizer_model_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer 'bert' \(supported: gpt2, llama, gemma4\)"):
        handmade_sentencepiece(tmp_path, {"a": -1.0}, model="bert")


def test_a_sentencepiece_byte_piece_alone_is_its_byte(tmp_path):
    """A `<0xNN>` piece (byte fallback) is byte NN as one token, as logprobs show it,
    not the text "<0xNN>"."""
    ours = sentencepiece_tokenizer(tmp_path)
    ids = ours.encode("🙂", add_special_tokens=False)[-4:]
    pieces = [ours.token_piece(token_id) for token_id in ids]
    assert pieces[0] == ("bytes:\\xf0", b"\xf0")
    assert b"".join(raw for _, raw in pieces) == "🙂".encode()


def test_gemma_merges_follow_the_order_of_the_pieces_not_their_scores(tmp_path):
    """Gemma files rank merges by the pieces' order in the file: "ab" before "bc",
    although "bc" scores higher (a Llama file ranks by score: "bc" first)."""
    pieces = {"a": -5.0, "b": -5.0, "c": -5.0, "ab": -9.0, "bc": -1.0}
    gemma, ids = handmade_sentencepiece(tmp_path, pieces, architecture="gemma3")
    assert gemma.encode("abc") == [ids["ab"], ids["c"]]
    llama, _ = handmade_sentencepiece(tmp_path, pieces)
    assert llama.encode("abc") == [ids["a"], ids["bc"]]


def gemma4_tokenizer(tmp_path: Path):
    """A Gemma 4 vocabulary as its converter writes one: placeholder scores, the merges
    deciding, byte pieces for byte fallback; "\n\n" and "a\n" pieces no merge makes."""
    pieces = ["a", "b", "c", "\u2581", "\n", "ab", "bc", "\u2581b", "\n\n", "a\n", "<0xC3>", "<0xA9>"]
    merges = ["b c", "a b", "\u2581 b", "a \n"]
    return handmade_sentencepiece(tmp_path, dict.fromkeys(pieces, -1000.0), "gemma4", merges, model="gemma4")


def test_gemma4_tokenizer_merges_by_the_files_merges_over_newline_runs_and_the_rest(tmp_path):
    ours, ids = gemma4_tokenizer(tmp_path)
    encode = functools.partial(ours.encode, add_special_tokens=False)
    assert encode("abc") == [ids["a"], ids["bc"]]  # the merges' order: "b c" first
    assert encode("a b") == [ids["a"], ids["\u2581b"]]  # a space is "▁", no prefix before the text
    # Runs of newlines and of the rest are split apart: a run that is a piece stays
    # whole, and nothing merges across a line's end ("a\n" is a merge, not a token here).
    assert encode("a\n\nb") == [ids["a"], ids["\n\n"], ids["b"]]
    assert encode("a\nb") == [ids["a"], ids["\n"], ids["b"]]
    assert encode("é") == [ids["<0xC3>"], ids["<0xA9>"]]  # byte fallback
    assert ours.decode(encode("a b\n\né")) == "a b\n\né"
    assert ours.encode("a") == [1, ids["a"]]  # BOS, as llama.cpp forces, though the file says not


@pytest.mark.parametrize(
    ("pre", "add_bos", "expected"),
    [
        ("tekken", None, True), ("llama-bpe", None, True), ("llama3", None, True), ("smaug-bpe", None, False),
        ("dbrx", None, False), ("qwen2", None, False), ("gpt-2", None, False), (None, None, False), ("tekken", False, False),
        ("qwen2", True, True),
    ],
)
def test_a_byte_level_vocabulary_adds_bos_where_llama_cpp_assumes_it(
    make_checkpoint, tmp_path, pre, add_bos, expected
):
    """llama.cpp adds BOS to tekken's and Llama 3's vocabularies when the file is silent
    (smaug-bpe's and dbrx's split is Llama 3's, their BOS not; Phi-4's files name dbrx)."""
    from tests.runtime.test_gguf import rewritten

    split = {"llama3": "llama-bpe", "smaug-bpe": "llama-bpe", "dbrx": "llama-bpe", None: "gpt-2"}.get(pre, pre)  # None: no name
    checkpoint = byte_level_checkpoint(make_checkpoint, tmp_path, split)
    path = write_gguf(checkpoint, tmp_path / "model.gguf", tmp_path / "reference", pre_tokenizer=pre or split)
    bos = 1
    metadata = {"tokenizer.ggml.bos_token_id": (bos, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT32)}
    if add_bos is not None:
        metadata["tokenizer.ggml.add_bos_token"] = (add_bos, gguf.GGUFValueType.BOOL, gguf.GGUFValueType.BOOL)
    dropped = (() if add_bos is not None else ("tokenizer.ggml.add_bos_token",)) + (() if pre else ("tokenizer.ggml.pre",))
    path = rewritten(path, tmp_path / "bos.gguf", metadata, dropped=dropped)
    ids = tokenizer_from_gguf(Metadata(gguf.GGUFReader(path), str(path)), "llama").encode("Hello")
    assert (ids[0] == bos) is expected and ids.count(bos) == int(expected)
