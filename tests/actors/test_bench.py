"""`cadence bench ...`: a bad flag is argparse's one-line error, before any measuring."""

import pytest

from actors import bench
from actors.cli import _parser

PAGED = ["bench", "paged-attention", "--batches", "1", "--contexts", "16", "--repeats", "1"]


def refused(capsys, argv) -> str:
    """The one stderr line of parsing `argv`, which must fail with exit status 2."""
    with pytest.raises(SystemExit) as exit:
        _parser().parse_args(argv)
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize(
    "flag",
    ["--batches", "--contexts", "--layers", "--heads", "--kv-heads", "--head-dim"]
    + ["--block-size", "--repeats"],
)
def test_paged_attention_refuses_a_size_or_count_of_zero(capsys, flag):
    line = refused(capsys, [*PAGED, flag, "0"])
    assert line.startswith(f"cadence bench paged-attention: error: argument {flag}:")


def test_paged_attention_refuses_heads_that_do_not_share_kv_heads_evenly(capsys):
    args = _parser().parse_args([*PAGED, "--heads", "3", "--kv-heads", "2"])
    with pytest.raises(SystemExit) as exit:
        args.run(args)
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("--heads (3) must be a multiple of --kv-heads (2)")


def test_paged_attention_refuses_a_step_past_the_memory_available(capsys, monkeypatch):
    monkeypatch.setattr(bench, "available_memory", lambda: 1 << 30)
    # 16 rows x 16,384 tokens x 64 x 2 x (4 + 16) heads x 4 bytes: 2.5 GiB
    args = _parser().parse_args([*PAGED, "--batches", "1", "16", "--contexts", "16384"])
    with pytest.raises(SystemExit) as exit:
        args.run(args)  # was killed for memory (--contexts 100000000), not refused
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "the largest step (16 rows of 16384 tokens) needs ~2.5 GiB, more than the 1.0 GiB available"
    )


@pytest.mark.parametrize("command", ["serve", "soak"])
@pytest.mark.parametrize("path", ["/nonexistent/out.json", ".", ""])
def test_the_json_path_is_checked_before_the_run_whose_results_it_would_lose(capsys, command, path):
    line = refused(capsys, ["bench", command, "--json", path])
    assert line.startswith(f"cadence bench {command}: error: argument --json: {path!r}")


@pytest.mark.parametrize("flag", ["--max-tokens", "--context", "--repeats"])
def test_ladder_refuses_a_size_or_count_of_zero(capsys, flag):
    line = refused(capsys, ["bench", "ladder", flag, "0"])
    assert line.startswith(f"cadence bench ladder: error: argument {flag}:")
