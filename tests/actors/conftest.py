"""Fixtures for the actor tests.

`pipeline` runs the real actors around a pure-Python engine and an inline "MLX
thread", so the protocol can be tested on trio's virtual clock (each step takes
`step_seconds` of virtual time). `tiny` is a real tiny checkpoint for end-to-end tests.
"""

from __future__ import annotations

import contextlib
import types
from collections import deque
from pathlib import Path
from typing import Any

from runtime.errors import RequestError
from runtime.kv.blocks import BlockPool
from runtime.scheduler import FcfsScheduler
from runtime.sequence import (
    FinishCause,
    SeqHandle,
    SequenceParams,
    StepBatch,
    StepOutcome,
    TokenLogprob,
)
from runtime.tokenizer import Tokenizer

import pytest
import trio

from actors.service import run_actors

DEMO_DIR = Path(__file__).resolve().parents[2] / "runtime" / "demo"


class FakeEngine:
    """Every sampling span emits `token`; a row finishes with LENGTH at its max_tokens.

    A span samples when it reaches the row's newest token, as in the real Engine.
    `calls` records ("submit", step, request ids) and ("collect", step) in order.
    """

    def __init__(self, *, max_batch: int = 4, max_context: int = 256, token: int = 300):
        self.max_batch = max_batch
        self.max_context = self.kv_tokens = max_context
        self.kv_bound = None  # the pool holds the context: the model's bound is named
        self.eos_ids: frozenset[int] = frozenset()  # rows end at max_tokens
        self.token = token
        self.rows: dict[int, list[Any]] = {}  # seq_id -> [params, num_generated, num_pending]
        self.queued: deque[tuple[int, list[int]]] = deque()
        self.calls: list[tuple[Any, ...]] = []
        self.failing: set[str] = set()  # request ids whose next decode fails
        self._next_id = 0
        self._num_steps = 0

    def open(self, params: SequenceParams) -> SeqHandle:
        if len(params.prompt_tokens) + params.max_tokens > self.max_context:
            raise RequestError("too long", code="context_length_exceeded")
        self._next_id += 1
        self.rows[self._next_id] = [params, 0, 0]
        return SeqHandle(self._next_id)

    def close(self, seq: SeqHandle) -> None:
        self.rows.pop(seq.seq_id, None)

    def drop_state(self, seq: SeqHandle) -> None:
        pass  # no recurrent state here

    def submit(self, batch: StepBatch) -> None:
        self._num_steps += 1
        live = [span for span in batch.spans if span.seq_id in self.rows]
        self.calls.append(
            ("submit", self._num_steps, tuple(self.rows[s.seq_id][0].request_id for s in live))
        )
        sampling = []
        for span in live:
            row = self.rows[span.seq_id]
            if span.end == len(row[0].prompt_tokens) + row[1] + row[2]:
                row[2] += 1
                sampling.append(span.seq_id)
        self.queued.append((self._num_steps, sampling))

    def _logprob(self, row: list[Any]) -> TokenLogprob | None:
        """When asked: -n/1000 for the row's n-th token, so order and gaps show."""
        num_top = row[0].sampling.logprobs
        if num_top is None:
            return None
        logprob = -row[1] / 1000
        return TokenLogprob(logprob, ((self.token, logprob),) * num_top)

    def collect(self) -> list[StepOutcome]:
        step, ids = self.queued.popleft()
        self.calls.append(("collect", step))
        outcomes = []
        for seq_id in ids:
            row = self.rows.get(seq_id)
            if row is None:
                continue  # closed
            row[2] -= 1
            if row[1] >= row[0].max_tokens:
                continue  # a speculative step past the finish
            if row[0].request_id in self.failing:
                row[1] = row[0].max_tokens
                outcomes.append(StepOutcome(seq_id, None, FinishCause.ERROR, "injected fault"))
                continue
            row[1] += 1
            finish = FinishCause.LENGTH if row[1] >= row[0].max_tokens else None
            outcomes.append(StepOutcome(seq_id, self.token, finish, logprob=self._logprob(row)))
        return outcomes

    @property
    def num_open(self) -> int:
        return len(self.rows)

    @property
    def num_pending(self) -> int:
        return len(self.queued)

    def start_queued(self) -> None:
        self.calls.append(("start",))

    def submits_with(self, request_id: str) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "submit" and request_id in c[2]]


class InlineThread:
    """Runs engine calls on the trio thread; a collect costs `step_seconds` (virtual)."""

    def __init__(self, step_seconds: float = 0.01):
        self.step_seconds = step_seconds

    async def run(
        self, fn: Any, *args: Any, abandon_on_cancel: bool = False, then: Any = None
    ) -> Any:
        if getattr(fn, "__name__", "") in ("collect", "_launch_then_collect"):
            await trio.sleep(self.step_seconds)
        result = fn(*args)
        if then is not None:
            then()
        return result


def fake_loaded(name: str = "fake") -> Any:
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    return types.SimpleNamespace(
        name=name,
        tokenizer=tokenizer,
        config=types.SimpleNamespace(vocab_size=tokenizer.vocab_size, model_type="llama"),
    )


@pytest.fixture
def pipeline():
    """`async with pipeline(max_batch=.., max_waiting=.., lookahead=.., **engine_args) as (llm, engine)`."""

    @contextlib.asynccontextmanager
    async def start(*, max_batch=4, max_waiting=8, drain_timeout=None, lookahead=1, **engine_args):
        engine = FakeEngine(max_batch=max_batch, **engine_args)
        pool = BlockPool(num_blocks=256, block_size=4)
        policy = FcfsScheduler(
            max_batch,
            pool,
            engine.max_context,
            prefill_chunk=4,
            max_num_batched_tokens=max_batch + 4,
        )
        async with run_actors(
            InlineThread(), fake_loaded(), engine, policy, max_waiting, drain_timeout, lookahead
        ) as llm:
            yield llm, engine

    return start


@pytest.fixture
def demo_tokenizer():
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="session")
def tiny(make_checkpoint):
    """A real tiny llama checkpoint (random weights): its directory name is the model name."""
    return make_checkpoint("llama")
