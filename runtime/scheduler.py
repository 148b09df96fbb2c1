"""First-come-first-served continuous batching, as a sans-IO policy object.

The scheduler actor feeds it events (`add`, `abort`, `finish`) and asks it for the
next step (`schedule`). It speaks in request ids and never touches the Engine: the
GPU actor owns the handles and turns a `StepPlan` into `Engine` calls.

Each step, in order:
  1. admit waiting requests, oldest first, while a batch row is free (`opens`);
  2. give prefilling rows one prompt piece each, oldest first, within a token budget,
     so a long prompt never stalls the decoding rows and an abort lands between pieces;
  3. decode every row whose prompt is in the KV but for its last token (a row may
     take its final piece and its first decode in the same step: pieces run first).

Plans may run ahead of results (lookahead): the policy counts a scheduled piece as
done, because the engine runs steps in submission order.
"""

from __future__ import annotations

import collections

from runtime.sequence import PrefillPiece, SequenceParams

import attrs


@attrs.define
class ScheduledRequest:
    request_id: str
    params: SequenceParams
    num_prefilled: int = 0  # prompt tokens already handed out in prefill pieces

    @property
    def num_to_prefill(self) -> int:
        """Prompt tokens that go through prefill: all but the last, which the first decode feeds."""
        return max(len(self.params.prompt_tokens) - 1, 0)

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < self.num_to_prefill


@attrs.frozen
class StepPlan:
    """One step for the GPU actor, in request ids.

    `closes` lists every request that left since the last plan by abort, whether or
    not it ever had a row: the GPU frees the rows it has and reports all of them back
    as released, so the streamer can forget them.
    """

    step: int
    opens: tuple[tuple[str, SequenceParams], ...] = ()
    closes: tuple[str, ...] = ()
    prefill: tuple[tuple[str, PrefillPiece], ...] = ()
    decode: tuple[str, ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        return sum(piece.length for _, piece in self.prefill)



@attrs.define
class FcfsScheduler:
    max_batch: int
    prefill_chunk: int = 256  # tokens per prefill piece
    max_prefill_tokens: int = 512  # prefill tokens per step, over all rows
    waiting: collections.deque[ScheduledRequest] = attrs.Factory(collections.deque)
    running: dict[str, ScheduledRequest] = attrs.Factory(dict)  # insertion order = FCFS
    pending_closes: list[str] = attrs.Factory(list)
    num_steps: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch, prefill_chunk and max_prefill_tokens must be positive")

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


    @property
    def has_work(self) -> bool:
        """True when `schedule()` would return a plan."""
        return bool(self.pending_closes or self.running or self.waiting)

    def is_known(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def add(self, request_id: str, params: SequenceParams) -> None:
        if self.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already scheduled")
        self.waiting.append(ScheduledRequest(request_id, params))

    def abort(self, request_id: str) -> str | None:
        """Drop a request; returns where it was ("waiting" or "running"), None if unknown."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.pending_closes.append(request_id)
                return "waiting"
        if self.running.pop(request_id, None) is not None:
            self.pending_closes.append(request_id)
            return "running"
        return None

    def finish(self, request_id: str) -> None:
        """The engine finished the row and the GPU actor already freed it."""
        self.running.pop(request_id, None)

    def schedule(self) -> StepPlan | None:
        if not self.has_work:
            return None
        opens = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
            opens.append((request.request_id, request.params))
        budget = self.max_prefill_tokens
        prefill, decode = [], []
        for request in self.running.values():
            if request.is_prefilling and budget > 0:
                length = min(
                    self.prefill_chunk, budget, request.num_to_prefill - request.num_prefilled
                )
                prefill.append((request.request_id, PrefillPiece(request.num_prefilled, length)))
                request.num_prefilled += length
                budget -= length
            if not request.is_prefilling:
                decode.append(request.request_id)
        self.num_steps += 1
        plan = StepPlan(
            step=self.num_steps,
            opens=tuple(opens),
            closes=tuple(self.pending_closes),
            prefill=tuple(prefill),
            decode=tuple(decode),
        )
        self.pending_closes.clear()
        return plan
