"""The batch ladder (runtime/ladder.py): which sizes pad to which, and that padding a
step changes no token and stores no K/V for the pads."""

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.kv.base import RowSpan
from runtime.ladder import (
    BatchLadder,
    PaddedForward,
    _dtype,
    _in_features,
    _layer_linears,
    measure_ladder,
    pad_step,
)
from runtime.runner import run_offline

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.runtime.test_engine import params, policy_for


def test_pads_to_the_cheapest_larger_size_only_past_the_noise_margin():
    ladder = BatchLadder((3.0, 5.0, 4.8, 4.0, 6.0, 6.1, 6.2, 4.5))
    assert ladder.padded(2) == 4  # 4.0 < 0.95 * 5.0
    assert ladder.padded(3) == 4  # 4.0 < 0.95 * 4.8
    assert ladder.padded(1) == 1  # nothing larger is cheaper
    assert ladder.padded(4) == 4
    assert ladder.padded(5) == 8  # 4.5 < 0.95 * 6.0, three pads
    assert ladder.padded(9) == 9  # above the table: as is
    assert BatchLadder((5.0, 4.9)).padded(1) == 1  # a 2% saving is noise, not a rung
    assert BatchLadder((9.0, 4.0, 4.0)).padded(1) == 2  # of equal costs, the fewest pads
    assert BatchLadder((20.0, 19.0)).padded(1) == 1  # exactly 5% is not below the margin
    assert BatchLadder((20.0, 18.9)).padded(1) == 2
    assert ladder.padded(0) == 0  # an empty step stays empty
    assert ladder.describe()["pads"] == {
        "2->4": 1.0,
        "3->4": 0.8,
        "5->8": 1.5,
        "6->8": 1.6,
        "7->8": 1.7,
    }


def test_pad_step_is_a_no_op_without_a_ladder_or_a_rung():
    tokens = mx.arange(3, dtype=mx.int32)
    view = object()
    assert pad_step(None, tokens, view) == (tokens, view)
    assert pad_step(BatchLadder((1.0, 1.0, 1.0)), tokens, view) == (tokens, view)


class _RecordingView:
    positions = mx.array([5, 6, 7], dtype=mx.int32)

    def __init__(self):
        self.seen = []

    def attend(self, layer, q, k, v, scale, window=None):
        self.seen.append((layer, q.shape[0], k.shape[0], v.shape[0], window))
        return q * 2


def test_pads_never_reach_attention_and_come_back_as_zeros():
    inner = _RecordingView()
    view = PaddedForward(inner, num_real=3, num_padded=8)
    assert view.positions.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    q = mx.ones((8, 2, 4))
    out = view.attend(1, q, q, q, 0.5, window=4)  # extra arguments pass through
    assert inner.seen == [(1, 3, 3, 3, 4)]
    assert out.shape == (8, 2, 4)
    assert out[:3].tolist() == (q[:3] * 2).tolist()
    assert mx.all(out[3:] == 0).item()


class _RecordingSharedView(_RecordingView):
    def attend_shared(self, layer, q, k, v, scale, window=None):
        self.seen.append((layer, q.shape[0], k.shape[0], v.shape[0], window))
        return q * 3


def test_pads_never_reach_a_kv_shared_layers_attention_and_come_back_as_zeros():
    """Gemma 4's KV-shared layers attend through `attend_shared`: the same cut as `attend`."""
    inner = _RecordingSharedView()
    view = PaddedForward(inner, num_real=3, num_padded=8)
    q = mx.ones((8, 2, 4))
    out = view.attend_shared(2, q, q, q, 1.0, window=4)
    assert inner.seen == [(2, 3, 3, 3, 4)]
    assert out.shape == (8, 2, 4)
    assert out[:3].tolist() == (q[:3] * 3).tolist()
    assert mx.all(out[3:] == 0).item()


@pytest.fixture(scope="module")
def engine(make_checkpoint):
    return Engine(load_model(make_checkpoint("llama")), max_batch=8, max_context=256)


def test_padded_steps_give_the_same_greedy_tokens(engine):
    prompts = {f"r{i}": [7 + i, 300, 42 + 3 * i, 977, 5] * (i + 1) for i in range(5)}
    requests = {rid: params(p, 12) for rid, p in prompts.items()}

    def run():
        out = run_offline(engine, policy_for(engine, chunk=8, budget=13), requests, lookahead=2)
        return {rid: list(r.tokens) for rid, r in out.items()}

    plain = run()
    engine.ladder = BatchLadder(tuple(float(32 - n) for n in range(1, 33)))  # pad all to 32
    assert engine.ladder.padded(5) == 32
    calls = []
    hidden = engine.model.hidden
    engine.model.hidden = lambda tokens, kv, keep: calls.append(tokens.shape[1]) or hidden(tokens, kv, keep)
    try:
        assert run() == plain
    finally:
        engine.ladder = None
        del engine.model.hidden
    assert calls and set(calls) == {32}  # every forward really ran padded


def test_measures_every_size_for_the_models_own_layers(engine):
    layer = engine.model.model.layers[0]
    projections = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                   "gate_up_proj", "down_proj"}
    named = {name.rsplit(".", 1)[-1] for name, _ in layer.named_modules()} & projections
    assert len(_layer_linears(engine.model)) == len(named) >= 4  # every projection, whatever its kind
    ladder = measure_ladder(engine.model, engine.config.num_hidden_layers, 6)
    assert len(ladder.ms) == 6 and all(ms > 0 for ms in ladder.ms)
    assert all(n <= ladder.padded(n) <= 6 for n in range(1, 7))


def test_the_real_rows_k_v_is_stored_as_without_pads(engine):
    """A padded forward writes the same pool contents: pads store nothing."""
    spans = [RowSpan(0, 0, 3, (0,)), RowSpan(1, 0, 2, (1,))]
    tokens = mx.array([11, 12, 13, 21, 22], dtype=mx.int32)
    keys = engine.kv.keys

    def stored(ladder):
        for layer in range(len(keys)):
            keys[layer] = mx.zeros_like(keys[layer])
        t, view = pad_step(ladder, tokens, engine.kv.forward(spans, 0))
        out = engine.model.hidden(t[None], view)[0][:5]
        mx.eval(out, engine.kv.keys)
        return [k for k in engine.kv.keys], out

    plain_keys, plain_out = stored(None)
    padded_keys, padded_out = stored(BatchLadder((9.0,) * 5 + (1.0,) * 3))
    assert mx.allclose(plain_out, padded_out, atol=1e-5).item()
    for a, b in zip(plain_keys, padded_keys, strict=True):
        assert mx.array_equal(a, b).item()


class _QuantizedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.QuantizedLinear(64, 32, bits=8)  # weight [32, 64 * 8 / 32]
        self.down_proj = nn.QuantizedLinear(128, 64, bits=4)
        self.down_proj.scales = self.down_proj.scales.astype(mx.float16)
        self.down_proj.biases = self.down_proj.biases.astype(mx.float16)


def test_measures_quantized_layers_at_their_real_input_width_and_dtype():
    """A quantized layer's packed weight is narrower than its input: 8 bits, 4 a word."""

    class Model:
        model = type("Inner", (), {"layers": [_QuantizedLayer()]})()

    linears = _layer_linears(Model())
    assert sorted((_in_features(m), str(_dtype(m))) for m in linears) == [
        (64, str(mx.float32)),
        (128, str(mx.float16)),
    ]
    ladder = measure_ladder(Model(), 2, 3)
    assert len(ladder.ms) == 3 and all(ms > 0 for ms in ladder.ms)
