"""The batch ladder as a user turns it on: `open_llm(batch_ladder=True)` (the serve flag
`--batch-ladder`) and `cadence bench ladder`."""

import subprocess
import sys

from structlog.testing import capture_logs

import actors
from actors.cli import _parser


async def test_batch_ladder_is_measured_at_start_up_and_changes_no_token(tiny):
    prompts = ["The quick brown fox", "def main():", "Hello"]

    async def greedy_texts(**kwargs):
        texts = []
        async with actors.open_llm(tiny, max_batch=4, **kwargs) as llm:
            for prompt in prompts:
                async with llm.generate(prompt, max_tokens=12) as generation:
                    texts.append("".join([delta.text async for delta in generation]))
        return texts

    with capture_logs() as logs:
        laddered = await greedy_texts(batch_ladder=True)
    events = [e for e in logs if e["event"] == "batch_ladder"]
    assert len(events) == 1 and events[0]["sizes"] == 4  # 1..max_batch
    assert laddered == await greedy_texts()


def test_bench_ladder_prints_a_row_per_size(tiny):
    result = subprocess.run(
        [sys.executable, "-m", "actors.cli", "bench", "ladder", "--model", str(tiny)]
        + ["--max-tokens", "3", "--repeats", "1", "--context", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [
        line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2", "3"]
    assert "ms padded" in result.stdout


def test_bench_ladder_refuses_a_context_beyond_the_model_in_one_line(tiny, capsys):
    argv = ["bench", "ladder", "--model", str(tiny), "--context", "99999", "--max-tokens", "2"]
    args = _parser().parse_args(argv)
    assert args.run(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("cadence bench ladder: error: --context 99999 needs 100001 positions")


def test_bench_ladder_refuses_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    args = _parser().parse_args(["bench", "ladder", "--model", str(tmp_path / "absent")])
    assert args.run(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"cadence bench ladder: error: {tmp_path / 'absent'}")


def test_bench_ladder_runs_a_model_with_sliding_window_layers(make_checkpoint, capsys):
    """Its rows had a table for group 0 only: 'row 0: 1 block tables for 2 layer groups'
    escaped as a traceback for every Gemma 2/3/4 and gpt-oss model. Past the window here,
    so the windowed tables hold only the blocks it reads."""
    windowed = make_checkpoint("gemma3_text", num_layers=2, sliding_window=8, sliding_window_pattern=2)
    argv = ["bench", "ladder", "--model", str(windowed), "--max-tokens", "3", "--repeats", "1", "--context", "40"]
    args = _parser().parse_args(argv)
    assert args.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2", "3"]


def test_bench_ladder_runs_a_hybrid_model_from_zero_recurrent_states(make_checkpoint, capsys):
    """Its views had no recurrent state: every Qwen3.5 size raised in its first
    linear-attention layer."""
    hybrid = make_checkpoint("qwen3_5_text", num_layers=4)
    argv = ["bench", "ladder", "--model", str(hybrid), "--max-tokens", "3", "--repeats", "1", "--context", "20"]
    args = _parser().parse_args(argv)
    assert args.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2", "3"]
