"""A chat's second turn: its time to first token with the prefix cache and without.

    python examples/make_qwen3_5_checkpoint.py /tmp/qwen3_5-ckpt
    python examples/bench_chat_turns.py --model /tmp/qwen3_5-ckpt [--words 450]

Turn 2 sends turn 1's prompt and reply again, then a new question: with the prefix
cache its prefill starts where turn 1 left off (a hybrid model's from a snapshot of
its recurrent state), without it the whole conversation is computed again. Each arm
starts `cadence serve` in a subprocess (`--no-prefix-cache` in the second), streams
both turns greedily with the official `openai` client, and prints each turn's time to
first token, its prompt and cached tokens, and whether the two arms' turn-2 replies
are the same text (they must be: a hit gives exactly a cold run's tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import openai
from bench_http import start_server

SENTENCE = "the quick brown fox jumps over a lazy dog while seven owls watch from an old oak"


def turn(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    """(seconds to the first token, the reply, prompt tokens, cached prompt tokens)."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, text, usage = None, [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert first is not None and usage is not None
    details = usage.prompt_tokens_details
    return first, "".join(text), usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--words", type=int, default=450, help="turn 1's message, in words")
    parser.add_argument("--max-tokens", type=int, default=24, help="each reply's tokens")
    args = parser.parse_args()
    words = SENTENCE.split()
    question = " ".join(words[i % len(words)] for i in range(args.words))
    replies = []
    for arm, extra in (("prefix cache", []), ("--no-prefix-cache", ["--no-prefix-cache"])):
        server, url, model = start_server(args.model, 4096, extra)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            turn(client, model, [{"role": "user", "content": "warm up"}], 4)
            chat = [{"role": "user", "content": question}]
            ttft1, reply, prompt1, _ = turn(client, model, chat, args.max_tokens)
            chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
            ttft2, reply2, prompt2, cached2 = turn(client, model, chat, args.max_tokens)
            replies.append(reply2)
            print(
                f"{arm:>18}: turn 1 {ttft1:6.2f} s to first token ({prompt1} prompt tokens); "
                f"turn 2 {ttft2:6.2f} s ({prompt2} prompt tokens, {cached2} cached)",
                flush=True,
            )
        finally:
            server.terminate()
            server.wait()
    print(f"turn 2's replies {'match' if replies[0] == replies[1] else 'DIFFER'}")


if __name__ == "__main__":
    main()
