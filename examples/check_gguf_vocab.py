"""Check GGUF tokenizers against llama.cpp's reference vocabularies.

llama.cpp's source tree ships vocabulary-only GGUF files (models/ggml-vocab-*.gguf)
beside test strings (.inp) and the ids the original Hugging Face tokenizer gives them
(.out). This encodes every string with the tokenizer cadence rebuilds from each file
and counts the matches, and decodes each encoding back to its string:

    python examples/check_gguf_vocab.py path/to/llama.cpp/models

(the directory also ships in the llama-cpp-python sdist, under vendor/llama.cpp/).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import runtime  # noqa: F401  (the fast BLAS loads before mlx)
from runtime.errors import CheckpointError
from runtime.gguf_reader import Metadata
from runtime.gguf_tokenizer import tokenizer_from_gguf

import gguf

SEPARATOR = "\n__ggml_vocab_test__\n"


def check(path: Path) -> str:
    metadata = Metadata(gguf.GGUFReader(path), str(path))
    try:
        tokenizer = tokenizer_from_gguf(metadata, metadata.string("general.architecture"))
    except CheckpointError as exc:
        return f"not loaded: {exc}"
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    num_encoded = sum(
        tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()]
        for text, ids in zip(texts, expected, strict=False)
    )
    num_decoded = sum(
        tokenizer.decode(tokenizer.encode(text, False), skip_special_tokens=False) == text
        for text in texts
    )
    return f"encode {num_encoded}/{len(texts)}, decode round trip {num_decoded}/{len(texts)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir", type=Path, help="llama.cpp's models/ directory")
    args = parser.parse_args()
    paths = sorted(args.models_dir.glob("ggml-vocab-*.gguf"))
    # A wrong directory printed nothing and exited 0, as if every vocabulary had passed.
    if not any(Path(f"{path}.inp").exists() for path in paths):
        parser.error(f"{args.models_dir}: no ggml-vocab-*.gguf files with their .inp tests")
    for path in paths:
        if Path(f"{path}.inp").exists():
            print(f"{path.name}: {check(path)}", flush=True)


if __name__ == "__main__":
    main()
