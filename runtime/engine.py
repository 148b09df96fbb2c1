"""The batch-native Engine: one decode entry where a single sequence is a batch of one.

    seq = engine.open(SequenceParams(prompt_tokens=..., max_tokens=...))
    engine.prefill(seq, PrefillPiece(0, len(prompt) - 1))   # any chunking
    engine.submit(StepBatch(decode=(seq, ...)))              # step N+1 queued ...
    outcomes = engine.collect()                               # ... while N is read

`submit` builds the step's graph and starts it with `mx.async_eval`; `collect`
blocks on the oldest submitted step. Each row's next input is the lazily sampled
token of its previous step, so step N+1 can be queued before step N's tokens are
known. A row that finishes at step N may already sit in step N+1: that speculative
token is dropped and its KV append undone.

Every method must run on one thread: mlx streams belong to the thread that made them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

from runtime.checkpoint import LoadedModel
from runtime.errors import RequestError
from runtime.finishing import finish_step
from runtime.kv.base import KVState, RowSpan
from runtime.kv.dense import DenseKV
from runtime.sampling import RowSampler, sample
from runtime.sequence import (
    FinishCause,
    PrefillPiece,
    SeqHandle,
    SequenceParams,
    StepBatch,
    StepOutcome,
)

import attrs
import mlx.core as mx


@attrs.define
class _Row:
    handle: SeqHandle
    params: SequenceParams
    slot: int
    sampler: RowSampler
    eos_ids: frozenset[int]
    tokens: list[int]  # prompt, then every collected token
    num_computed: int = 0  # tokens whose K/V are stored, counting queued steps
    next_input: mx.array | None = None  # [1] lazily sampled token of the last queued step
    num_inflight: int = 0  # queued decode steps not yet collected
    finished: FinishCause | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.params.prompt_tokens)


@attrs.frozen
class _QueuedStep:
    seq_ids: tuple[int, ...]
    tokens: mx.array  # [B] int32
    is_finite: mx.array  # [B] bool: the row's logits had no NaN/inf
    failures: tuple[tuple[int, str], ...]  # rows that failed while the step was built


@attrs.frozen
class SeqSnapshot:
    """A sequence's tokens and KV, to resume it later without recomputing."""

    params: SequenceParams
    tokens: tuple[int, ...]
    kv: KVState


def check_sequence(
    params: SequenceParams, *, max_context: int, vocab_size: int, prompt_field: str = "prompt"
) -> None:
    """Raise RequestError unless `params` can run; pure, so admission calls it off-thread too.

    `prompt_field` names the request field the prompt came from ("prompt" or "messages").
    """
    prompt = params.prompt_tokens
    if not prompt:
        raise RequestError(f"'{prompt_field}' encodes to no tokens", param=prompt_field)
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestError("'max_tokens' must be at least 1", param="max_tokens")
    if len(prompt) + (params.max_tokens or 1) > max_context:
        asked = params.max_tokens or "at least 1"
        raise RequestError(
            f"this model's maximum context length is {max_context} tokens; the prompt has "
            f"{len(prompt)} tokens and max_tokens asks for {asked} more",
            param="max_tokens" if params.max_tokens else prompt_field,
            code="context_length_exceeded",
        )
    if any(not 0 <= t < vocab_size for t in prompt):
        raise RequestError(
            f"token ids in '{prompt_field}' must be in 0..{vocab_size - 1}", param=prompt_field
        )
    if any(not 0 <= t < vocab_size for t, _ in params.sampling.logit_bias):
        raise RequestError(
            f"logit_bias keys must be token ids in 0..{vocab_size - 1}", param="logit_bias"
        )


class Engine:
    def __init__(self, loaded: LoadedModel, *, max_batch: int = 16, max_context: int | None = None):
        config = loaded.config
        self.model = loaded.model
        self.config = config
        self.max_batch = max_batch
        self.max_context = min(max_context or config.max_position_embeddings, config.max_position_embeddings)
        self.eos_ids = frozenset(config.eos_token_ids) | loaded.tokenizer.eos_token_ids
        dtype = self.model.model.norm.weight.dtype
        self.kv = DenseKV(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            num_slots=max_batch,
            max_length=self.max_context,
            dtype=dtype,
        )
        self._rows: dict[int, _Row] = {}
        self._queued: deque[_QueuedStep] = deque()
        self._ids = itertools.count()

    # -- sequences ---------------------------------------------------------------

    def open(self, params: SequenceParams) -> SeqHandle:
        check_sequence(params, max_context=self.max_context, vocab_size=self.config.vocab_size)
        slot = self.kv.allocate()
        handle = SeqHandle(next(self._ids))
        self._rows[handle.seq_id] = _Row(
            handle=handle,
            params=params,
            slot=slot,
            sampler=RowSampler.create(params.sampling, params.prompt_tokens, self.config.vocab_size),
            eos_ids=frozenset() if params.ignore_eos else self.eos_ids | params.stop_token_ids,
            tokens=list(params.prompt_tokens),
        )
        return handle

    def close(self, seq: SeqHandle) -> None:
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self.kv.free(row.slot)

    @property
    def num_open(self) -> int:
        return len(self._rows)

    @property
    def num_free_slots(self) -> int:
        return self.kv.num_free_slots

    @property
    def num_pending(self) -> int:
        return len(self._queued)

    # -- steps -------------------------------------------------------------------

    def prefill(self, seq: SeqHandle, piece: PrefillPiece) -> None:
        self.submit(StepBatch(prefill=((seq, piece),)))

    def step(self, batch: StepBatch) -> list[StepOutcome]:
        self.submit(batch)
        return self.collect()

    def submit(self, batch: StepBatch) -> bool:
        """Queue prefill pieces, then one decode forward over the ready rows.

        Returns True when a step was queued for `collect`; a batch with only prefill
        pieces (or only rows that finished meanwhile) queues none.
        """
        for seq, piece in batch.prefill:
            self._run_piece(self._rows[seq.seq_id], piece)
        rows, inputs, failures = [], [], []
        for seq in batch.decode:
            row = self._rows.get(seq.seq_id)
            if row is None or row.finished is not None:
                continue  # closed or done since the batch was planned
            try:
                inputs.append(self._row_input(row))
                rows.append(row)
            except Exception as exc:  # one row's fault must not sink its batch
                row.finished = FinishCause.ERROR
                failures.append((row.handle.seq_id, f"{type(exc).__name__}: {exc}"))
        if not rows and not failures:
            if batch.prefill:  # start the pieces now rather than at the next decode
                mx.async_eval(self.kv.keys, self.kv.values)
            return False
        seq_ids: tuple[int, ...] = ()
        tokens, is_finite = mx.array([], dtype=mx.int32), mx.array([], dtype=mx.bool_)
        if rows:
            seq_ids, tokens, is_finite = self._decode(rows, inputs)
        mx.async_eval(tokens, is_finite)
        self._queued.append(_QueuedStep(seq_ids, tokens, is_finite, tuple(failures)))
        return True

    def synchronize(self) -> None:
        """Block until all submitted work, prefill pieces included, has run."""
        mx.synchronize()

    def collect(self) -> list[StepOutcome]:
        """Block for the oldest queued step and decide which rows it finished."""
        step = self._queued.popleft()
        outcomes = [StepOutcome(sid, None, FinishCause.ERROR, err) for sid, err in step.failures]
        tokens: list[int] = step.tokens.tolist()  # type: ignore[assignment]  # [B] -> list
        finite: list[bool] = step.is_finite.tolist()  # type: ignore[assignment]
        for seq_id, token, is_finite in zip(step.seq_ids, tokens, finite, strict=True):
            row = self._rows.get(seq_id)
            if row is None:
                continue
            row.num_inflight -= 1
            if row.finished is not None:
                row.num_computed -= 1  # a speculative step past the finish: undo its append
                continue
            if not is_finite:
                row.finished = FinishCause.ERROR
                outcomes.append(StepOutcome(seq_id, None, FinishCause.ERROR, "non-finite logits"))
                continue
            row.tokens.append(token)
            row.finished = finish_step(
                token=token,
                num_generated=row.num_generated,
                tokens=row.tokens,
                max_tokens=row.params.max_tokens,
                context_length=len(row.tokens),
                max_context=self.max_context,
                eos_ids=row.eos_ids,
                repetition_window=row.params.repetition_window,
            )
            outcomes.append(StepOutcome(seq_id, token, row.finished))
        return outcomes

    # -- snapshots ---------------------------------------------------------------

    def snapshot(self, seq: SeqHandle) -> SeqSnapshot:
        """Copy a row's tokens and KV out; the row must have no queued step."""
        row = self._rows[seq.seq_id]
        if row.num_inflight:
            raise RuntimeError("snapshot needs the row's queued steps collected first")
        kv = self.kv.export(row.slot, row.num_computed)
        return SeqSnapshot(params=row.params, tokens=tuple(row.tokens), kv=kv)

    def restore(self, snapshot: SeqSnapshot, params: SequenceParams | None = None) -> SeqHandle:
        """Open a row that resumes `snapshot`; `params` may change sampling and limits."""
        seq = self.open(params or snapshot.params)
        row = self._rows[seq.seq_id]
        self.kv.load(row.slot, snapshot.kv)
        row.tokens = list(snapshot.tokens)
        row.num_computed = snapshot.kv.length
        return seq

    # -- internals ---------------------------------------------------------------

    def _run_piece(self, row: _Row, piece: PrefillPiece) -> None:
        last_prompt = len(row.params.prompt_tokens) - 1
        if piece.start != row.num_computed or piece.start + piece.length > last_prompt:
            raise ValueError(
                f"prefill piece [{piece.start}, {piece.start + piece.length}) does not continue "
                f"row {row.handle.seq_id} at {row.num_computed} within its first {last_prompt}"
            )
        tokens = mx.array(row.tokens[piece.start : piece.start + piece.length], dtype=mx.int32)
        view = self.kv.forward([RowSpan(row.slot, piece.start, piece.length)])
        # Only the K/V writes are wanted: nothing reads the hidden states, so the
        # lazy graph skips the last layer's MLP and the vocab projection.
        self.model.hidden(tokens[None], view)
        row.num_computed += piece.length

    def _row_input(self, row: _Row) -> mx.array:
        """The token this row feeds next: [1] int32, possibly not computed yet."""
        if row.num_computed < len(row.params.prompt_tokens) - 1:
            raise ValueError(f"row {row.handle.seq_id} still has prompt tokens to prefill")
        if row.next_input is not None:
            return row.next_input
        return mx.array(row.tokens[row.num_computed : row.num_computed + 1], dtype=mx.int32)

    def _decode(
        self, rows: Sequence[_Row], inputs: Sequence[mx.array]
    ) -> tuple[tuple[int, ...], mx.array, mx.array]:
        # Slot order lets dense storage attend over its pool without gathering rows.
        rows, inputs = zip(*sorted(zip(rows, inputs, strict=True), key=lambda p: p[0].slot), strict=True)
        view = self.kv.forward([RowSpan(r.slot, r.num_computed, 1) for r in rows])
        tokens = mx.concatenate(list(inputs))[:, None]  # [B, 1]
        hidden = self.model.hidden(tokens, view)  # [B, 1, hidden]
        logits = self.model.project(hidden[:, -1, :])  # [B, V]
        is_finite = mx.isfinite(logits.sum(axis=-1))  # a NaN or inf anywhere poisons the sum
        sampled = sample(logits, [r.sampler for r in rows])  # [B]
        for i, row in enumerate(rows):
            row.next_input = sampled[i : i + 1]
            row.sampler.record(row.next_input)
            row.num_computed += 1
            row.num_inflight += 1
        return tuple(r.handle.seq_id for r in rows), sampled, is_finite
