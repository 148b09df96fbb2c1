"""`cadence serve --model file.gguf` as a user runs it: in a subprocess, over HTTP with
the official openai client; a file that cannot load is one line on stderr and status 2."""

import json
import signal
import subprocess
import sys

import runtime  # noqa: F401  (the fast BLAS loads before mlx)
from runtime.gguf_synth import write_gguf

import openai
import pytest
from gguf import GGMLQuantizationType as GGMLType

CLI = [sys.executable, "-m", "actors.cli"]


@pytest.fixture
def q8_gguf(make_checkpoint, tmp_path):
    checkpoint = make_checkpoint("qwen3")
    return write_gguf(
        checkpoint, tmp_path / "tiny-q8_0.gguf", tmp_path / "reference", GGMLType.Q8_0
    )


def test_serve_answers_a_chat_from_a_gguf_file(q8_gguf):
    process = subprocess.Popen(
        [*CLI, "serve", "--model", str(q8_gguf), "--port", "0", "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            event = json.loads(line)
            if event["event"] == "ready":
                break
        else:
            raise AssertionError("the server exited before it was ready")
        client = openai.OpenAI(base_url=f"{event['url']}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-q8_0.gguf"]
        reply = client.chat.completions.create(
            model="tiny-q8_0.gguf",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        assert reply.choices[0].message.content
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("damage", ["truncated", "unknown-architecture"])
def test_serve_with_a_bad_gguf_prints_one_line_and_exits_2(q8_gguf, tmp_path, damage):
    data = q8_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    else:  # same-length architecture name, so every offset in the file still holds
        bad.write_bytes(data.replace(b"qwen3", b"zzzz9"))
    result = subprocess.run(
        [*CLI, "serve", "--model", str(bad), "--port", "0", "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("cadence: error: ") and str(bad) in result.stderr
    assert ("truncated" if damage == "truncated" else "'zzzz9'") in result.stderr
