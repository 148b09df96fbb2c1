"""`cadence bench load`: each load's seconds, weights and peak memory, in a fresh process."""

import shutil

import pytest

from actors import bench_load
from actors.cli import _parser
from tests.runtime.test_cpu_weights import EIGHT_LAYERS  # in bf16: 17 MB, 5.3 MB at 4 bits


def bench(capsys, *argv: str) -> tuple[int, list[str], str]:
    args = _parser().parse_args(["bench", "load", *argv])
    status = args.run(args)
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def test_each_form_and_the_peer_get_a_row_with_their_own_figures(make_checkpoint, capsys):
    path = make_checkpoint("llama", dtype="bfloat16", **EIGHT_LAYERS)
    status, lines, _ = bench(capsys, "--model", str(path), "--cpu-quantize", "off", "4", "--compare")
    assert status == 0
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert table[0] == [
        "loader", "seconds", "weights MB", "resident before MB", "peak resident MB", "(peak - before) / weights"
    ]
    figures = {label: [float(cell.removesuffix("x")) for cell in cells] for label, *cells in table[1:]}
    assert list(figures) == ["cadence --cpu-quantize off", "cadence --cpu-quantize 4", "mlx-lm load"]
    weights = {label: values[1] for label, values in figures.items()}
    assert weights == {  # MB: 16 bits kept by both, 4 bits and a float32 scale and bias a 64
        "cadence --cpu-quantize off": 17.0,
        "cadence --cpu-quantize 4": 5.3,
        "mlx-lm load": 17.0,
    }
    for _seconds, weights_mb, before_mb, peak_mb, ratio in figures.values():
        assert peak_mb > before_mb + weights_mb * 0.9  # the load's own share
        assert ratio == pytest.approx((peak_mb - before_mb) / weights_mb, rel=0.03)  # MB rounded


def test_a_path_that_is_no_checkpoint_is_one_line_before_any_table(tmp_path, capsys):
    status, out, err = bench(capsys, "--model", str(tmp_path / "missing"))
    assert (status, out) == (2, [])
    assert err.splitlines() == [
        f"cadence bench load: error: {tmp_path / 'missing'}: "
        "no such directory, and not a Hugging Face repo id"
    ]


def test_a_checkpoint_its_load_refuses_is_that_loads_one_line(make_checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(make_checkpoint("llama"), broken)
    (broken / "config.json").write_text("{")
    status, _, err = bench(capsys, "--model", str(broken))
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith(f"cadence bench load: error: cadence --cpu-quantize off: {broken / 'config.json'}")


def test_compare_without_mlx_lm_says_what_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_load, "has_mlx_lm", lambda: False)
    status, _, err = bench(capsys, "--model", str(tmp_path), "--compare")
    assert (status, err.strip()) == (2, "cadence bench load: error: --compare needs mlx-lm (pip install mlx-lm)")
