"""`cadence bench serve` against a live server on the tiny checkpoint, and its helpers."""

import argparse
import contextlib
import http.server
import json
import os
import random
import re
import shutil
import socket
import struct
import sys
import threading
import types
from collections import deque
from pathlib import Path

from runtime.errors import CadenceError, CheckpointError
from runtime.tokenizer import Tokenizer

import attrs
import mlx.core as mx
import numpy as np
import pytest
import trio

import actors
from actors import bench_model, bench_serve, bench_servers, loadgen
from actors.bench_blas import Unpinned
from actors.bench_model import Floor, count_parameters, measure_floor
from actors.http_app import ServerState, create_app
from actors.http_server import serving_on_loopback
from actors.loadgen import (
    Outcome,
    Request,
    Span,
    Target,
    Workload,
    _Stream,
    build_requests,
    parse_span,
    percentile,
    summarize,
)
from kernels.cpu_extension import kernel_status


@contextlib.asynccontextmanager
async def serving(checkpoint, max_body_bytes=1 << 20):
    state = ServerState()
    async with (
        serving_on_loopback(
            create_app(state, max_body_bytes=max_body_bytes), graceful_timeout=0.1
        ) as url,
        actors.open_llm(checkpoint, max_batch=4) as llm,
    ):
        state.llm = llm
        yield url


async def bench(tmp_path, *argv):
    """`cadence bench serve ARGV --json ...` on a worker thread: (exit status, report)."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv, "--json", str(tmp_path / "out.json")])
    status = await trio.to_thread.run_sync(bench_serve.main, args)
    return status, json.loads((tmp_path / "out.json").read_text())


LOAD = ["--requests", "6", "--clients", "3", "--max-tokens", "8", "--prompt-tokens", "10:30"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_run_against_a_live_server_counts_every_token(tiny, tmp_path, endpoint):
    async with serving(tiny) as url:
        status, report = await bench(tmp_path, "--url", url, *LOAD, "--endpoint", endpoint)
    assert status == 0
    (run,) = report["runs"]["server"]
    assert (run["num_requests"], run["num_ok"], run["num_errors"]) == (6, 6, 0)
    assert run["num_output_tokens"] == 6 * 8  # ignore_eos: every request runs to max_tokens
    assert run["num_prompt_tokens"] >= 6 * 10  # the server's own count, template included
    assert run["output_tok_s"] > 0
    assert 0 < run["ttft_p50"] <= run["ttft_p99"]
    assert 0 <= run["itl_p50"] <= run["itl_p99"] <= run["worst_gap"]


async def test_with_the_checkpoint_the_report_holds_each_runs_floors(tiny, tmp_path, capsys, monkeypatch):
    # A server the bench did not start does not inherit its OpenBLAS pin: nothing to time.
    monkeypatch.setattr(bench_serve, "measure_unpinned", lambda checkpoint: pytest.fail("timed"))
    async with serving(tiny) as url:
        status, report = await bench(tmp_path, "--url", url, "--checkpoint", str(tiny), *LOAD)
    (run,) = report["runs"]["server"]
    rate = report["floor"]["gemm_flops"] / report["floor"]["flops_per_token"]  # tokens a second
    assert status == 0 and rate > 0
    assert run["prompt_floor_seconds"] == pytest.approx(run["num_prompt_tokens"] / rate)
    assert run["floor_seconds"] == pytest.approx(
        (run["num_prompt_tokens"] + run["num_output_tokens"]) / rate
    )
    printed = capsys.readouterr().out
    ratio = run["ttft_p99"] / run["prompt_floor_seconds"]
    assert f"{run['prompt_floor_seconds']:.2f} s ({ratio:.2f}x)" in printed
    # Which CPU and kernels measured it: the figures differ ~2x with and without AVX-512.
    assert f"machine: {report['machine']}" in printed
    assert kernel_status() in report["machine"] and f"{os.cpu_count()} CPUs" in report["machine"]
    # The tiny checkpoint's parameters read as what they are, not "0M".
    parameters = report["floor"]["flops_per_token"] / 2e6
    assert parameters < 1 and f" x 2 x {parameters:.2g}M parameters" in printed
    assert report["unpinned_blas"] is None and "pins OpenBLAS" not in printed


async def test_a_rate_run_sends_every_request(tiny, tmp_path):
    async with serving(tiny) as url:
        argv = ["--url", url, "--rate", "20", "--requests", "5", "--max-tokens", "4:6"]
        status, report = await bench(tmp_path, *argv)
    (run,) = report["runs"]["server"]
    assert (status, run["label"], run["num_ok"]) == (0, "20 req/s", 5)
    assert 5 * 4 <= run["num_output_tokens"] <= 5 * 6


async def test_server_errors_are_counted_not_raised(tiny, tmp_path):
    async with serving(tiny) as url:
        status, report = await bench(tmp_path, "--url", url, "--model", "no-such-model", *LOAD)
    (run,) = report["runs"]["server"]
    assert status == 1
    assert (run["num_ok"], run["num_errors"], run["num_output_tokens"]) == (0, 6, 0)
    ((message, count),) = run["errors"].items()
    assert message.startswith("HTTP 404") and count == 6


async def test_an_unreachable_url_is_one_line_not_a_traceback(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", "http://127.0.0.1:9"])  # the discard port
    assert bench_serve.main(args) == 2
    assert "http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_the_floor_counts_gemma4s_experts_a_token_runs_and_not_its_per_layer_table(make_checkpoint):
    """Its experts by its own name for k (`top_k_experts`), 2 of 4; its per-layer inputs'
    table is a lookup; its tied embedding the head. One layer: full (a last layer is),
    so heads of twice head_dim."""
    h, heads, kv, d, ffn, experts, top_k, per_layer = 64, 4, 2, 16, 128, 4, 2, 8
    variant = {"enable_moe_block": True, "hidden_size_per_layer_input": per_layer}
    shape = dict(num_layers=1, head_dim=d, tie_word_embeddings=True, gemma4=variant)
    checkpoint = make_checkpoint("gemma4_text", **shape)
    config = json.loads((checkpoint / "config.json").read_text())
    attention = 2 * h * heads * 2 * d + 2 * h * kv * 2 * d + 2 * 2 * d  # q, o; k, v; q/k norms
    mlp = 3 * h * ffn + top_k * 3 * h * ffn + (h * experts + h + experts)  # dense, experts, router
    norms = 7 * h + h  # the layer's seven and the per-layer input's
    layer_inputs = 2 * h * per_layer + 1  # its gate and projection, the layer scalar
    model = h * 1 * per_layer + per_layer  # the per-layer projection and its norm
    expected = attention + mlp + norms + layer_inputs + model + h + config["vocab_size"] * h
    assert count_parameters(checkpoint) == expected


@pytest.mark.parametrize(
    ("workload", "most_at_once"),
    [(Workload(6, clients=2), 2), (Workload(6, rate=10.0), 6)],
    ids=["clients", "rate"],
)
async def test_clients_bound_the_streams_and_a_rate_does_not(
    workload, most_at_once, monkeypatch, autojump_clock
):
    live, peak = 0, 0

    async def ten_second_request(target, workload, request):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        start = trio.current_time()
        await trio.sleep(10)
        live -= 1
        return Outcome(None, 1, 1, start, trio.current_time(), (start + 1,))

    monkeypatch.setattr(loadgen, "stream_request", ten_second_request)
    requests = [Request("hi", 1, 1)] * 6
    result = await loadgen.run_load(Target("http://x", "m"), workload, requests, show=False)
    assert (result.num_ok, peak) == (6, most_at_once)


def test_spans_are_a_number_or_a_range():
    assert parse_span("100") == Span(100, 100)
    assert parse_span("100:400") == Span(100, 400)
    assert str(parse_span("100:400")) == "100:400" and str(parse_span("7")) == "7"
    for bad in ("", "x", "0", "5:3", "1:2:3", "-4"):
        with pytest.raises(ValueError):
            parse_span(bad)
    rng = random.Random(0)
    draws = {Span(3, 5).draw(rng) for _ in range(100)}
    assert draws == {3, 4, 5}


def test_percentiles_interpolate_like_numpy():
    rng = random.Random(0)
    for size in (1, 2, 7, 100):
        values = [rng.random() for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) == 0.0


def test_prompts_have_the_drawn_lengths_and_share_the_prefix(demo_tokenizer):
    workload = Workload(8, clients=2, prompt_tokens=Span(40, 80), shared_prefix=0.5)
    requests = build_requests(workload, demo_tokenizer)
    assert len({r.prompt for r in requests}) == 8
    for r in requests:
        assert 40 <= r.num_prompt_tokens <= 80
        num_tokens = len(demo_tokenizer.encode(r.prompt, add_special_tokens=False))
        assert abs(num_tokens - r.num_prompt_tokens) <= 2  # re-encoding may merge at a seam
    shared = min(len(r.prompt) for r in requests) // 3  # well inside 40 x 0.5 tokens of text
    assert len({r.prompt[:shared] for r in requests}) == 1
    no_prefix = build_requests(Workload(8, clients=2, prompt_tokens=Span(40, 80)), None)
    assert [len(r.prompt.split()) for r in no_prefix] == [r.num_prompt_tokens for r in no_prefix]
    assert len({r.prompt.split()[0] for r in no_prefix}) > 1


def test_the_floor_counts_the_weights_a_token_multiplies(make_checkpoint):
    h, kv, ffn, layers = 64, 2 * 16, 128, 2  # the tiny llama: 4 heads, 2 KV heads of 16
    config = json.loads((make_checkpoint("llama") / "config.json").read_text())
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h  # q, o; k, v; the MLP; norms
    expected = layers * per_layer + h + config["vocab_size"] * h  # final norm, the head
    assert count_parameters(make_checkpoint("llama")) == expected  # the lookup table is free
    assert count_parameters(make_checkpoint("llama", tie_word_embeddings=True)) == expected
    assert count_parameters(make_checkpoint("llama", quantize=(32, 4))) == expected  # unpacked
    floor = Floor(expected, gemm_flops=1e9, gemm_shape=(256, 64, 128))
    assert floor.seconds(1000) == pytest.approx(1000 * 2 * expected / 1e9)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("quantize", [None, (32, 4)], ids=["per-expert", "stacked-q4"])
def test_the_floor_counts_the_experts_a_token_runs(make_checkpoint, family, quantize):
    """Routed experts count as the top 2 of the 4 a token runs through; the router, and
    qwen2_moe's shared expert (twice as wide) and its gate, whole."""
    h, kv, ffn, layers, experts, top_k = 64, 2 * 16, 128, 2, 4, 2
    config = json.loads((make_checkpoint(family) / "config.json").read_text())
    per_layer = 2 * h * h + 2 * h * kv + top_k * 3 * h * ffn + h * experts + 2 * h
    per_layer += 2 * 16 if family == "qwen3_moe" else 0  # q/k norms of one head
    per_layer += 3 * h * 2 * ffn + h + (h + 2 * kv) if family == "qwen2_moe" else 0  # + q/k/v biases
    expected = layers * per_layer + h + config["vocab_size"] * h
    assert count_parameters(make_checkpoint(family, quantize=quantize)) == expected


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_the_floor_counts_the_deepseek_experts_a_token_runs(make_checkpoint, family):
    """DeepSeek's configs name their experts `n_routed_experts`: 2 of the 4 a token runs,
    beside the shared experts and the dense first layer, whole."""
    path = make_checkpoint(family, num_layers=3)
    weights = mx.load(str(path / "model.safetensors"))
    routed = sum(w.size for name, w in weights.items() if ".experts." in name)
    rest = sum(w.size for name, w in weights.items() if ".experts." not in name and name != "model.embed_tokens.weight")
    assert routed and count_parameters(path) == rest + routed * 2 // 4


@pytest.mark.parametrize(
    ("config", "weights", "said"),
    [
        ("{", None, "not valid JSON"),
        ('{"model_type": "llama"}', None, "hidden_size and intermediate_size"),
        ('{"hidden_size": 1000000, "intermediate_size": 1000000}', None, "at most 2**30"),
        (None, b"garbage!" + b"\xff" * 8, "a header of"),
        (None, struct.pack("<Q", 3) + b"[1]", "malformed header"),
        (None, struct.pack("<Q", 3) + b"{{{", "not JSON"),
    ],
    ids=["config-json", "config-keys", "config-huge", "header-size", "header-shape", "header-json"],
)
def test_a_checkpoint_the_floor_cannot_read_is_one_checkpoint_error(
    make_checkpoint, tmp_path, config, weights, said
):
    """The floor read config.json and the safetensors headers unchecked: a JSONDecodeError,
    a KeyError or a MemoryError (garbage read as a header's size) came out as tracebacks."""
    checkpoint = shutil.copytree(make_checkpoint("llama"), tmp_path / "ck")
    if config is not None:
        (checkpoint / "config.json").write_text(config)
    if weights is not None:
        (checkpoint / "model.safetensors").write_bytes(weights)
    with pytest.raises(CheckpointError, match=re.escape(said)):
        count_parameters(checkpoint) if weights is not None else measure_floor(checkpoint)


def test_a_gguf_file_or_a_hub_id_is_no_checkpoint_directory_for_the_floor(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for given in (tmp_path / "model.gguf", Path("org/repo")):
        with pytest.raises(CheckpointError, match="reads a local checkpoint directory"):
            measure_floor(given)


def test_the_peer_runs_as_many_prompts_and_streams_at_once_as_cadence():
    """Its best configuration: its defaults (8 prompts at a time) ran 16 clients slower."""
    args = bench_servers.mlx_lm_args(Path("ckpt"), 8123, 12)
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--decode-concurrency"] == "12"
    assert flags["--prompt-concurrency"] == "12"
    assert flags["--model"] == "ckpt" and flags["--port"] == "8123"


def test_a_runs_figures_come_from_its_streams_stamps():
    """TTFT to the first text, gaps between texts pooled over streams, the worst gap, the
    wall time to the last end (failed streams included) and tokens from the good ones."""
    ok_a = Outcome(None, 10, 4, start=0.0, end=2.0, stamps=(0.5, 0.7, 1.2, 1.3))
    ok_b = Outcome(None, 20, 3, start=0.1, end=1.5, stamps=(0.4, 0.6, 0.8))
    failed = Outcome("connection: reset", 30, 9, start=0.2, end=4.0, stamps=(3.0, 3.5))
    result = summarize("x", [ok_a, ok_b, failed], start=0.0)
    assert (result.num_requests, result.num_ok, result.num_errors) == (3, 2, 1)
    assert result.errors == {"connection: reset": 1}
    assert result.seconds == 4.0  # the run lasts until its last stream ended
    assert (result.num_prompt_tokens, result.num_output_tokens) == (30, 7)
    assert result.output_tok_s == pytest.approx(7 / 4.0)
    ttfts, gaps = [0.5, 0.3], [0.2, 0.5, 0.1, 0.2, 0.2]
    assert result.ttft_p50 == pytest.approx(np.percentile(ttfts, 50))
    assert result.ttft_p99 == pytest.approx(np.percentile(ttfts, 99))
    assert result.itl_p50 == pytest.approx(np.percentile(gaps, 50))
    assert result.itl_p99 == pytest.approx(np.percentile(gaps, 99))
    assert result.worst_gap == pytest.approx(0.5)


def test_only_chunks_that_carry_text_are_stamped():
    """A role-only first delta, an empty content and the usage chunk are no token's arrival."""
    stream = _Stream(start=0.0)
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": ""}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
    ]
    for event in events:
        stream.on_event(json.dumps(event).encode(), "chat")
    stream.on_event(b"[DONE]", "chat")
    assert len(stream.stamps) == 1 and stream.is_done
    assert (stream.num_prompt_tokens, stream.num_output_tokens) == (5, 1)
    text = _Stream(start=0.0)
    text.on_event(json.dumps({"choices": [{"text": ""}, {"text": "a"}]}).encode(), "completions")
    assert len(text.stamps) == 1


def test_reasoning_and_tool_call_deltas_are_output_tokens_too():
    """Stamped by `content` alone, a reasoning model's TTFT was the end of its thinking."""
    stream = _Stream(start=0.0)
    deltas = [
        {"reasoning_content": "Let"},
        {"reasoning": " me"},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {"content": "ok"},
        {"reasoning_content": "", "content": None, "tool_calls": []},  # carries nothing
    ]
    for delta in deltas:
        stream.on_event(json.dumps({"choices": [{"delta": delta}]}).encode(), "chat")
    assert len(stream.stamps) == 4


async def test_rounds_repeat_every_run_on_fresh_prompts_and_print_the_medians(
    tiny, tmp_path, capsys
):
    async with serving(tiny) as url:
        argv = ["--url", url, "--rounds", "2", "--clients", "2", "1", "--max-tokens", "4"]
        status, report = await bench(tmp_path, *argv)
    runs = report["runs"]["server"]
    assert status == 0 and report["workload"]["rounds"] == 2
    assert [(r["label"], r["round"]) for r in runs] == [
        ("2 clients", 1),
        ("1 client", 1),
        ("2 clients", 2),
        ("1 client", 2),
    ]
    assert [m["label"] for m in report["medians"]] == ["2 clients", "1 client"]
    out = capsys.readouterr().out
    assert "| 2 clients, round 2 | server |" in out and "medians of 2 rounds" in out
    args = argparse.Namespace(
        rate=None, clients=[2, 1], requests=None, seed=0, prompt_tokens=Span(20, 20),
        max_tokens=Span(4, 4), shared_prefix=0.0, endpoint="chat", ignore_eos=True, timeout=9.0,
    )  # fmt: skip
    prompts = [
        {r.prompt for w in bench_serve.workloads(args, i) for r in build_requests(w, None)}
        for i in range(2)
    ]
    assert len(prompts[0]) == 3 and not prompts[0] & prompts[1]  # no prompt seen twice


def result(label, tok_s):
    return loadgen.RunResult(label, 1, 1, 0, {}, 1.0, 10, 10, tok_s, 0, 0, 0, 0, 0)


def by_round(runs, loads=2):
    return [runs[i : i + loads] for i in range(0, len(runs), loads)]


def test_the_medians_are_per_load_and_the_ratios_per_round():
    ours = [result("1 client", 30), result("16 clients", 130), result("1 client", 33)]
    ours += [result("16 clients", 140), result("1 client", 36), result("16 clients", 120)]
    peer = [result("1 client", 10), result("16 clients", 50), result("1 client", 11)]
    peer += [result("16 clients", 70), result("1 client", 12), result("16 clients", 60)]
    one, sixteen = bench_serve.run_medians({"cadence": by_round(ours), "mlx-lm": by_round(peer)})
    assert one.label == "1 client" and sixteen.label == "16 clients"
    assert one.tok_s == {"cadence": (33, 30, 36), "mlx-lm": (11, 10, 12)}
    assert sixteen.ratios == pytest.approx((130 / 50, 140 / 70, 120 / 60))
    assert sixteen.median_ratio == pytest.approx(2.0)  # of the ratios, not 130 / 60
    alone, _ = bench_serve.run_medians({"server": by_round(ours)})
    assert alone.tok_s == {"server": (33, 30, 36)}
    assert alone.ratios == () and alone.median_ratio is None


def test_the_floor_columns_compare_the_run_with_its_compute_floor():
    """1,000 tokens a second at the floor: 3,000 prompt and 1,000 output tokens take it 4 s,
    so 1,000 output tokens over the run make 250 tok/s, of which 100 is 40%."""
    floor = Floor(1_000_000, gemm_flops=2e9, gemm_shape=(1, 1, 1))
    run = attrs.evolve(
        result("4 clients", 100.0), num_prompt_tokens=3000, num_output_tokens=1000, ttft_p99=1.5
    )
    assert bench_serve._floor_tok_s(floor, run) == "250.0 (40%)"
    assert bench_serve._prompt_floor(floor, run) == "3.00 s (0.50x)"
    idle = attrs.evolve(run, num_prompt_tokens=0, num_output_tokens=0)
    assert bench_serve._floor_tok_s(floor, idle) == bench_serve._prompt_floor(floor, idle) == "-"
    assert bench_serve._floor_tok_s(None, run) == "-"
    assert (bench_serve._ratio(3.0, 2.0), bench_serve._ratio(3.0, 0.0)) == ("1.50x", "-")


def test_a_run_that_beats_its_floor_is_flagged_under_the_table(capsys):
    """A floor timed on a busy box read 7 GFLOP/s: shares of 137% and 203% stood in the
    table with no word that the floor, not the server, was off."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", "http://127.0.0.1:9", "--clients", "4"])
    floor = Floor(1_000_000, gemm_flops=2e9, gemm_shape=(1, 1, 1))  # 250 tok/s for this run
    run = attrs.evolve(result("4 clients", 100.0), num_prompt_tokens=3000, num_output_tokens=1000)
    for tok_s, is_flagged in ((100.0, False), (300.0, True)):
        bench_serve._print(args, None, floor, {"server": [[attrs.evolve(run, output_tok_s=tok_s)]]})
        assert ("a run beat its floor" in capsys.readouterr().out) is is_flagged


def test_each_rounds_rows_print_that_rounds_figures(capsys):
    """Round by round, each server's row and the ratio row are that round's own."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", "http://127.0.0.1:9", "--clients", "4", "--rounds", "2"])
    results = {
        "cadence": [[result("4 clients", 100.0)], [result("4 clients", 140.0)]],
        "peer": [[result("4 clients", 50.0)], [result("4 clients", 40.0)]],
    }
    bench_serve._print(args, None, None, results)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 clients, round")]
    cells = [[cell.strip() for cell in row.split("|")[1:4]] for row in rows]
    assert cells == [
        ["4 clients, round 1", "cadence", "100.0"],
        ["4 clients, round 1", "peer", "50.0"],
        ["4 clients, round 1", "cadence / peer", "2.00x"],
        ["4 clients, round 2", "cadence", "140.0"],
        ["4 clients, round 2", "peer", "40.0"],
        ["4 clients, round 2", "cadence / peer", "3.50x"],
    ]


def test_the_warm_up_is_the_largest_load_on_prompts_no_measured_run_sends(tiny):
    """mlx's CUDA backend compiles a kernel the first time it meets a batch shape: one
    4-token request left a 64-client run a 30 s stall mid-stream (an H200)."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    argv = ["serve", "--checkpoint", str(tiny), "--prompt-tokens", "20:40", "--rounds", "2"]
    args = parser.parse_args([*argv, "--clients", "1", "16", "4"])
    warm = bench_serve.warm_up(args)
    assert (warm.clients, warm.num_requests, warm.rate) == (16, 16, None)
    assert (warm.prompt_tokens, warm.max_tokens) == (Span(20, 40), Span(4, 4))
    tokenizer = Tokenizer.from_dir(tiny)
    warm_prompts = {r.prompt for r in build_requests(warm, tokenizer)}
    measured = {
        r.prompt
        for round_index in range(2)
        for w in bench_serve.workloads(args, round_index)
        for r in build_requests(w, tokenizer)
    }
    assert len(warm_prompts) == 16 and not warm_prompts & measured
    at_a_rate = parser.parse_args([*argv, "--rate", "2", "--requests", "40", "--max-batch", "8"])
    assert bench_serve.warm_up(at_a_rate).clients == 8  # the most the server runs at once


async def test_each_server_takes_the_warm_up_load_before_its_measured_runs(tiny, tmp_path):
    sent = []
    real_run_load = bench_serve.run_load

    async def recording(target, workload, requests, show=True):
        sent.append((workload.max_tokens, show))
        return await real_run_load(target, workload, requests, show=False)

    bench_serve.run_load = recording
    try:
        async with serving(tiny) as url:
            status, _ = await bench(tmp_path, "--url", url, "--checkpoint", str(tiny), *LOAD)
    finally:
        bench_serve.run_load = real_run_load
    assert status == 0
    assert sent == [(Span(4, 4), False), (Span(8, 8), True)]


def test_with_compare_the_servers_take_turns_to_go_first(tiny, monkeypatch, tmp_path, capsys):
    started = []

    def fake_server(name):
        @contextlib.contextmanager
        def server(*args):
            started.append(name)
            yield Target("http://x", name)

        return server

    monkeypatch.setattr(bench_serve, "cadence_server", fake_server("cadence"))
    monkeypatch.setattr(bench_serve, "mlx_lm_server", fake_server("mlx-lm"))
    monkeypatch.setattr(bench_serve, "has_mlx_lm", lambda: True)
    floors = iter([Floor(1000, 1e9, (1, 1, 1)), Floor(1000, 3e9, (1, 1, 1))])  # before, after
    monkeypatch.setattr(bench_serve, "measure_floor", lambda checkpoint: next(floors))
    # The servers inherit a pin that slowed OpenBLAS: the faster unpinned timing is noted.
    monkeypatch.setattr(
        bench_serve, "measure_unpinned", lambda checkpoint: Unpinned("Haswell", 9e9, "x")
    )
    monkeypatch.setattr(
        bench_serve,
        "_measure",
        lambda target, warm, runs: [
            result(w.label, 100 if target.model == "cadence" else 50) for w, _ in runs
        ],
    )
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    argv = ["serve", "--checkpoint", str(tiny), "--compare", "--rounds", "3", "--clients", "1"]
    args = parser.parse_args([*argv, "--json", str(tmp_path / "out.json")])
    assert bench_serve.main(args) == 0
    assert started == ["cadence", "mlx-lm", "mlx-lm", "cadence", "cadence", "mlx-lm"]
    report = json.loads((tmp_path / "out.json").read_text())
    assert [len(runs) for runs in report["runs"].values()] == [3, 3]
    assert report["medians"][0]["median_ratio"] == pytest.approx(2.0)
    assert report["floor"]["gemm_flops"] == 3e9  # the faster timing: a busy box only slows it
    assert report["unpinned_blas"] == {"pinned": "Haswell", "gemm_flops": 9e9, "blas": "x"}
    assert "note: OPENBLAS_CORETYPE=Haswell pins" in capsys.readouterr().out


@contextlib.contextmanager
def answering(body: bytes, headers_seen: list | None = None, paths_seen: list | None = None):
    """A loopback HTTP server that answers every GET and POST with `body`: its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if headers_seen is not None:
                headers_seen.append(dict(self.headers))
            if paths_seen is not None:
                paths_seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.do_GET()

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


HTML_PAGE = b"<!DOCTYPE HTML>\n<html>\n  <body>\n" + b"<p>not an API</p>\n" * 100 + b"</html>\n"


@pytest.mark.parametrize(
    "body",
    [
        *(b'{"data": "x"}', b"[1, 2]", b'{"data": []}', b'{"data": [{"id": 5}]}'),
        *(b'{"data": [{"id": ""}]}', b"", HTML_PAGE),
    ],
    ids=["data-not-a-list", "a-list", "no-models", "id-not-a-string", "empty-id", "empty", "html"],
)
def test_a_server_that_lists_no_model_is_one_short_line_asking_for_model(capsys, body):
    with answering(body) as url:
        parser = argparse.ArgumentParser()
        bench_serve.add_parser(parser.add_subparsers())
        assert bench_serve.main(parser.parse_args(["serve", "--url", f"{url}/v1"])) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"cadence bench serve: {url}/v1/models: did not list a model")
    assert "(pass --model)" in line and len(line) < 350


def test_the_model_list_is_asked_for_with_the_api_key_when_there_is_one():
    headers_seen: list[dict] = []
    with answering(b'{"data": [{"id": "m"}]}', headers_seen) as url:
        assert bench_servers.first_model(f"{url}/v1", "sk-1") == "m"
        assert bench_servers.first_model(url, None) == "m"
    assert [seen.get("Authorization") for seen in headers_seen] == ["Bearer sk-1", None]


def test_cadence_is_ready_at_its_ready_event_not_at_an_earlier_one():
    lines = deque(["not json\n", "[1, 2]\n", "7\n", '{"event": "loading", "model": "m"}\n'])
    assert bench_servers._ready_event(lines) is None
    lines.append('{"event": "ready", "url": "http://127.0.0.1:9", "model": "m"}\n')
    assert bench_servers._ready_event(lines) == {
        "event": "ready",
        "url": "http://127.0.0.1:9",
        "model": "m",
    }


def test_a_server_that_exits_before_it_is_ready_ends_the_bench_with_its_last_lines():
    crash = "import sys; print('loading', file=sys.stderr); sys.exit('no such checkpoint')"
    command = [sys.executable, "-c", crash]
    with pytest.raises(SystemExit) as exited, bench_servers._running("x", command) as running:
        bench_servers._wait(*running, ready=lambda: None)
    assert str(exited.value) == "the server exited with 1:\nloading\nno such checkpoint\n"


def test_an_exited_servers_last_lines_still_in_the_pipe_are_waited_for():
    lines: deque[str] = deque()
    slow_reader = threading.Timer(0.3, lines.append, ["the last words\n"])
    slow_reader.start()
    exited = types.SimpleNamespace(poll=lambda: 1, returncode=1)
    with pytest.raises(SystemExit, match="the last words"):
        bench_servers._wait(exited, lines, slow_reader, ready=lambda: None)


def sse_body(*events):
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


async def test_a_stream_without_usage_counts_its_text_chunks_and_the_prompt_as_built():
    """A server that sends no usage chunk: a token per chunk that carried text, and the
    prompt's length as the load generator built it."""
    text = [{"choices": [{"delta": {"content": word}}]} for word in ("a", "b", "c")]
    body = sse_body({"choices": [{"delta": {"role": "assistant"}}]}, *text)
    with answering(body) as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error is None and len(outcome.stamps) == 3
    assert (outcome.num_prompt_tokens, outcome.num_output_tokens) == (7, 3)
    usage = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}}
    with answering(sse_body(*text, usage)) as url:
        counted = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert (counted.num_prompt_tokens, counted.num_output_tokens) == (12, 5)  # the server's


def test_a_run_with_no_streams_has_zero_figures_not_an_error():
    result = summarize("1 client", [], start=5.0)
    assert (result.num_requests, result.seconds, result.output_tok_s) == (0, 0.0, 0.0)
    assert (result.ttft_p50, result.itl_p99, result.worst_gap) == (None, None, None)
    # One stream that ended at once, with a single text chunk: no gap, no time.
    instant = Outcome(None, 3, 1, start=5.0, end=5.0, stamps=(5.0,))
    result = summarize("1 client", [instant], start=5.0)
    assert (result.seconds, result.output_tok_s, result.ttft_p50) == (0.0, 0.0, 0.0)
    assert (result.itl_p50, result.worst_gap) == (None, None)  # one piece of text: no gap


def test_streams_without_text_leave_latencies_unmeasured_not_zero(capsys):
    """A random-weight model over a 128K vocabulary, with a 2,048-token tokenizer,
    streamed ids that decode to nothing: the table read TTFT 0.00 s and ITL 0 ms."""
    silent = Outcome(None, 40, 8, start=5.0, end=5.3, stamps=())
    run = summarize("1 client", [silent], start=5.0)
    assert (run.num_ok, run.num_output_tokens) == (1, 8)
    assert (run.ttft_p50, run.ttft_p99, run.itl_p50, run.itl_p99, run.worst_gap) == (None,) * 5
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", "http://127.0.0.1:9", "--clients", "1"])
    floor = Floor(1_000_000, gemm_flops=2e9, gemm_shape=(1, 1, 1))
    peer = result("1 client", 20.0)
    bench_serve._print(args, None, floor, {"cadence": [[run]], "peer": [[peer]]})
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 client | cadence |"))
    assert "0.00 s" not in row and "| - | - |" in row and "0 ms" not in row
    ratios = next(line for line in out.splitlines() if "cadence / peer" in line)
    assert ratios.count("| - |") >= 2
    assert "carried no text" in out


def test_an_error_page_is_quoted_in_one_short_line():
    message = loadgen._error_message(HTML_PAGE)
    assert message.startswith("<!DOCTYPE HTML> <html> <body> <p>not an API</p>")
    assert "\n" not in message and len(message) <= 200
    json_error = b'{"error": {"message": "two\\nlines"}}'
    assert loadgen._error_message(json_error) == "two lines"


async def test_a_json_file_that_cannot_be_written_is_one_line_after_the_table(tiny, capsys):
    """/dev/full: the path checks pass, then the write fails as on a full disk."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *LOAD, "--json", "/dev/full"])
    async with serving(tiny) as url:
        args.url = url
        status = await trio.to_thread.run_sync(bench_serve.main, args)
    assert status == 2
    captured = capsys.readouterr()
    assert "| 3 clients | server |" in captured.out
    (line,) = captured.err.splitlines()
    assert line == "cadence bench serve: /dev/full: No space left on device"


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": [{"delta": "text"}]},
        ["a", "list"],
        "text",
        {"choices": "abc"},
        {"choices": [], "usage": 5},
        {"choices": [], "usage": {"prompt_tokens": "many"}},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": -1}},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": True}},
    ],
    ids=["text-delta", "list", "string", "choices-text", "usage-int", "count-text", "negative", "bool"],
)
async def test_a_chunk_not_shaped_as_openais_is_a_counted_bad_chunk(chunk):
    """The loadgen promises errors counted, never raised: these were AttributeError and
    TypeError tracebacks (every earlier run's figures lost), or a negative tok/s."""
    with answering(sse_body(chunk)) as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error is not None and outcome.error.startswith("bad chunk: ")
    assert outcome.num_output_tokens >= 0


async def test_a_chunk_nested_past_pythons_limit_is_a_bad_chunk():
    with answering(b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n") as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error is not None and outcome.error.startswith("bad chunk: RecursionError")


@contextlib.contextmanager
def closing_with(status: int, body: bytes):
    """A loopback server that answers `status` with a body delimited by the connection's
    close (no Content-Length, as HTTP/1.1 allows): its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(f"HTTP/1.1 {status} Oops\r\n\r\n".encode() + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    thread.join(10)


async def test_an_error_status_whose_body_ends_with_the_connection_is_still_reported():
    """It read "the stream ended without [DONE]": the server's 429 or 500 was lost."""
    with closing_with(429, b'{"error": {"message": "rate limited"}}') as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error == "HTTP 429: rate limited"


async def test_a_rate_run_ends_with_its_last_stream_not_one_more_gap():
    """It slept one more random gap after the last request (1,000 s on average at 0.001/s)."""
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    with answering(sse_body({"choices": [{"delta": {"content": "a"}}]}, usage)) as url:
        with trio.fail_after(30):
            result = await loadgen.run_load(
                Target(url, "m"), Workload(1, rate=0.001), [Request("hi", 3, 7)], show=False
            )
    assert result.num_requests == 1 and result.num_ok == 1


@pytest.mark.parametrize(
    "url",
    ["gpu-box:12345", "localhost:12345", "http://127.0.0.1:99999", "ftp://host:21", "http://"],
)
def test_a_url_that_names_no_http_server_is_refused_before_anything_runs(url, capsys):
    """With --model, "gpu-box:12345" (no scheme) went unchecked: the load went to
    127.0.0.1:80 and the report named gpu-box."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--url", url, "--model", "m"])
    assert "--url" in capsys.readouterr().err


def test_cadence_args_are_split_at_parse_time_and_cannot_silence_the_ready_event(monkeypatch):
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):  # an unclosed quote: argparse's line, no traceback
        parser.parse_args(["serve", "--cadence-args", "--api-key 'abc"])
    args = parser.parse_args(["serve", "--cadence-args", "--log-level warning --max-n 2"])
    assert args.cadence_args == ["--log-level", "warning", "--max-n", "2"]
    commands = []

    @contextlib.contextmanager
    def recorded(name, command):
        commands.append(command)
        raise SystemExit("stop here")
        yield

    monkeypatch.setattr(bench_servers, "_running", recorded)
    with pytest.raises(SystemExit), bench_servers.cadence_server(Path("ck"), 4, args.cadence_args):
        pass
    (command,) = commands
    # The bench's own log flags come last: argparse takes the last, and the ready event
    # is read from the JSON log at info (warning waited 10 minutes for it).
    assert command[-4:] == ["--log-format", "json", "--log-level", "info"]
    assert command.index("--max-n") < command.index("--log-format")


def test_the_bench_checkpoint_is_renamed_into_place_whole_and_a_leftover_is_rebuilt(
    tmp_path, monkeypatch
):
    """A build cut short by a full disk left a truncated checkpoint that every later
    run took as built (its tokenizer missing: "the checkpoint has no tokenizer")."""
    builds = []

    def fake_build(path, config):
        builds.append(path.name)
        (path / "model.safetensors").write_bytes(b"whole")
        (path / "tokenizer_config.json").write_text("{}")

    def full_disk(path, config):
        (path / "model.safetensors").write_bytes(b"trunc")
        raise RuntimeError("[write] Unable to write 36854 bytes to file.")

    leftover = tmp_path / "llama-200m-fp32-vocab2048"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"trunc")  # no tokenizer: cut short
    monkeypatch.setattr(bench_model, "_build", full_disk)
    with pytest.raises(CadenceError, match="could not build the benchmark checkpoint"):
        bench_model.bench_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [leftover.name]  # no partial build left
    monkeypatch.setattr(bench_model, "_build", fake_build)
    path = bench_model.bench_checkpoint(tmp_path)
    assert path == leftover and (path / "model.safetensors").read_bytes() == b"whole"
    assert bench_model.bench_checkpoint(tmp_path) == path and len(builds) == 1  # cached now


async def test_a_body_refused_while_it_is_sent_reports_the_servers_answer(tiny):
    """The server answers 413 before it has read a large body and closes: the send
    broke ("Broken pipe") and the answer saying why went unread."""
    async with serving(tiny, max_body_bytes=10_000) as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("x " * 2_000_000, 3, 7)
        )
    assert outcome.error is not None and outcome.error.startswith("HTTP 413"), outcome.error


def test_the_medians_are_medians_not_means_and_an_even_count_averages_the_middle_two():
    """The published figure is each server's median tok/s and the median of the ratios:
    one slow round must not pull it, and two rounds split the difference."""
    ours = [result("1 client", 30), result("1 client", 33), result("1 client", 90)]
    (load,) = bench_serve.run_medians({"server": by_round(ours, loads=1)})
    assert load.tok_s == {"server": (33, 30, 90)}  # the mean is 51
    ours, peer = [result("1 client", 20), result("1 client", 30)], [result("1 client", 10)] * 2
    (load,) = bench_serve.run_medians({"a": by_round(ours, 1), "b": by_round(peer, 1)})
    assert load.ratios == (2.0, 3.0) and load.median_ratio == 2.5


def test_the_latency_columns_print_seconds_and_milliseconds():
    assert (bench_serve._seconds(1.5), bench_serve._seconds(None)) == ("1.50 s", "-")
    assert (bench_serve._ms(0.034), bench_serve._ms(None)) == ("34 ms", "-")


def test_every_rate_round_draws_fresh_prompts():
    """A rate run repeated with the same seed sent the same prompts each round: a prefix
    cache carried over, and later rounds measured cache hits."""
    args = argparse.Namespace(
        rate=2.0, clients=[1], requests=None, seed=0, prompt_tokens=Span(20, 20),
        max_tokens=Span(4, 4), shared_prefix=0.0, endpoint="chat", ignore_eos=True, timeout=9.0,
    )  # fmt: skip
    first, second = (
        {r.prompt for w in bench_serve.workloads(args, i) for r in build_requests(w, None)}
        for i in range(2)
    )
    assert len(first) == 32 and not first & second  # 32: the documented default


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
async def test_a_url_with_or_without_v1_posts_to_v1_chat_completions(suffix):
    paths: list = []
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    with answering(sse_body(usage), paths_seen=paths) as url:
        outcome = await loadgen.stream_request(
            Target(url + suffix, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error is None and paths == ["/v1/chat/completions"]


async def test_sse_data_without_a_space_after_the_colon_is_read():
    """SSE allows `data:{...}`; the space after the colon is optional."""
    body = b'data:{"choices": [{"delta": {"content": "a"}}]}\n\ndata:[DONE]\n\n'
    with answering(body) as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error is None and len(outcome.stamps) == 1


async def test_an_error_event_mid_stream_is_counted_with_its_message():
    body = sse_body(
        {"choices": [{"delta": {"content": "a"}}]}, {"error": {"message": "out of memory"}}
    )
    with answering(body) as url:
        outcome = await loadgen.stream_request(
            Target(url, "m"), Workload(1, clients=1), Request("hi", 3, 7)
        )
    assert outcome.error == "out of memory"


def test_the_gemm_rate_is_two_flops_a_multiply_add_at_the_best_timed_call(tiny, monkeypatch):
    """The floor's rate: the fastest of the timed calls (not the warm-up's, not the
    last), and 2 x M x K x N FLOPs for it."""
    ticks = iter([0.0, 9.0, 10.0, 14.0, 20.0, 22.0, 30.0, 33.0])  # 9 (warm-up), 4, 2, 3
    monkeypatch.setattr(bench_model.time, "perf_counter", lambda: next(ticks))
    floor = measure_floor(tiny, tokens=8, repeats=3)
    m, k, n = floor.gemm_shape
    assert floor.gemm_flops == 2.0 * m * k * n / 2.0
