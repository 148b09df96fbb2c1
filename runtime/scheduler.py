"""Continuous batching over a block pool under a token budget, as a sans-IO policy.

The scheduler actor feeds it events (`add`, `abort`, `on_step_done`) and asks it
for the next step (`schedule`). It speaks in request ids and never touches the
Engine; it owns the KV block pool, so admission sees memory directly.

Requests are ranked by (priority, arrival): lower priority values first, then first
come, first served. Each step, in order:
  1. admit waiting requests by rank while a row is free (`max_batch`) and the pool
     can hold the prompt; a cached prefix is taken instead of recomputed, and a
     request whose next prompt block a running one is computing waits for it to be
     cached (so n choices of one prompt compute it once);
  2. fill the step's token budget (`max_num_batched_tokens`): every decoding row
     first, one token each, then prefilling rows a chunk each (`prefill_chunk`) from
     what the budget has left: by priority, then fewest prompt tokens left first, so
     a short prompt behind a long one waits a step or two, not for all of it. With no row decoding there is
     no stream to stall, and the budget and chunk grow to `solo_prefill_tokens`.
     A span that reaches the newest token samples, so a last chunk also yields the
     first token;
  0. before all that, if a decoding row's next token needs a block the pool doesn't
     have: plan nothing until the queued steps are done, then preempt by recompute
     the lowest-ranked running requests (the lowest priority, newest) until the
     decoding rows fit: free their blocks (cached ones stay shareable) and requeue
     them; each resumes by prefilling its prompt and generated tokens again, often
     from the prefix cache. Preempting only with nothing in flight keeps lookahead's
     queued steps valid, at the cost of one drained pipeline per preemption.

Plans run ahead of results (lookahead): a scheduled span counts as computed,
because the engine runs steps in submission order. A span never samples past a
request's max_tokens or context bound, so lookahead never speculates beyond them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from runtime.errors import CadenceError
from runtime.kv.blocks import BlockPool, chain_hashes
from runtime.kv.snapshots import SnapshotBook
from runtime.scheduled_request import ScheduledRequest
from runtime.scheduler_snapshots import SnapshotPlanning
from runtime.sequence import SequenceParams
from runtime.step_plan import PlannedSpan, StepPlan

import attrs

# Measured on the 2-core box with the native CPU attention (kernels/cpu/), 200M fp32
# bench model. Beside decoding rows (`cadence bench serve --clients 4 16 --max-tokens 64
# --prompt-tokens 150 --cadence-args="--prefill-chunk N"`): N = 96 / 144 / 192 gave 16
# clients 84 / 87 / 93 tok/s, TTFT p99 6.3 / 6.1 / 5.2 s, inter-token p99 314 / 368 /
# 417 ms, and a worst gap at 4 clients of 0.28 / 0.36 / 0.47 s; 288 took the 16-client
# inter-token p99 to 596 ms, past the 0.5 s target. After the op-count work of the
# same day (faster steps), N = 128 / 160 / 192 gave 16 clients 109 / 112 / 111 and
# 106 / 108 / 109 tok/s and a 4-client worst gap of 0.25 / 0.29 / 0.34 and 0.27 / 0.30
# / 0.36 s; 192 also showed 0.44 and 0.56 s gaps in two `--compare` runs, 160 0.32 and
# 0.34 s. With no row decoding nobody can stall, and a prompt alone is computed 512
# tokens a step (examples/bench_prefill.py, 512 / 6,000-token prompts: 555 / 240 tok/s
# in 256-token steps, 531 / 249 in 384, 547 / 266 in 512: a longer step streams the
# weights less often).
DEFAULT_PREFILL_CHUNK = 160
DEFAULT_SOLO_PREFILL_TOKENS = 512


@attrs.define
class FcfsScheduler(SnapshotPlanning):
    max_batch: int
    pool: BlockPool
    max_context: int
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # tokens per prefill span
    # A step's tokens over all rows; by default a token for each row and a prefill chunk.
    max_num_batched_tokens: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_batch + self.prefill_chunk, takes_self=True)
    )
    solo_prefill_tokens: int = DEFAULT_SOLO_PREFILL_TOKENS  # budget and chunk, no row decoding
    # A hybrid model's recurrent-state snapshots, where its prefixes are cached (else None).
    snapshots: SnapshotBook | None = None
    waiting: list[ScheduledRequest] = attrs.Factory(list)  # by rank
    running: dict[str, ScheduledRequest] = attrs.Factory(dict)
    pending_closes: list[str] = attrs.Factory(list)
    pending_rejects: list[tuple[str, str]] = attrs.Factory(list)
    pending_restores: list[tuple[str, int]] = attrs.Factory(list)  # (request id, snapshot id)
    in_flight: dict[int, dict[str, int]] = attrs.Factory(dict)  # step -> {request: num_computed}
    num_steps: int = 0
    num_preemptions: int = 0
    arrivals: itertools.count[int] = attrs.Factory(itertools.count)

    def __attrs_post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise CadenceError("max_batch and prefill_chunk must be positive")
        if self.max_num_batched_tokens < self.max_batch:
            raise CadenceError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_batch ({self.max_batch}): every decoding row needs its token"
            )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        """Requests or closes remain (a plan may still have to wait for a step to finish)."""
        return bool(self.pending_closes or self.pending_rejects or self.running or self.waiting)

    def is_known(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def add(self, request_id: str, params: SequenceParams) -> None:
        if self.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already scheduled")
        prompt = list(params.prompt_tokens)
        hashes = chain_hashes(prompt, self.pool.block_size, self.pool.salt)
        request = ScheduledRequest(request_id, params, prompt, hashes, arrival=next(self.arrivals))
        bisect.insort(self.waiting, request, key=lambda r: r.rank)

    def report_closed(self, request_id: str) -> None:
        """Name `request_id`, already gone (finished), in the next plan's closes."""
        self.pending_closes.append(request_id)

    def abort(self, request_id: str) -> str | None:
        """Drop a request; returns "waiting" (it never ran), "running", or None if unknown."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.pending_closes.append(request_id)
                return "running" if request.is_open else "waiting"
        if request_id in self.running:
            self._free(self.running.pop(request_id))
            self.pending_closes.append(request_id)
            return "running"
        return None

    def on_step_done(
        self, step: int, results: Sequence[tuple[str, int | None, bool, bool]]
    ) -> None:
        """Step `step` ran: (request id, sampled token or None, finished, inside the
        thought before its grammar) for each result."""
        computed = self.in_flight.pop(step, {})
        finished, failed = [], set()
        for request_id, token, is_finished, is_thinking in results:
            request = self.running.get(request_id)
            if request is None:
                continue
            if token is not None:
                request.tokens.append(token)
                request.is_thinking = is_thinking
            else:
                failed.add(request_id)  # its K/V may never have been written
            if is_finished:
                finished.append(request)
        for request_id, num_computed in computed.items():
            if request_id in failed:
                continue
            if (request := self.running.get(request_id)) is not None:
                request.num_kv_done = max(request.num_kv_done, num_computed)
                self._publish(request)
        if self.snapshots is not None:
            self.snapshots.on_step_done(step, self._snapshot_hash)
        for request in finished:
            del self.running[request.request_id]
            self._free(request)

    # -- planning ----------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can be planned until a step is done."""
        preempted = []
        while self._num_blocks_short() > 0:  # a decoding row can't grow: make room
            if self.in_flight:  # let the queued steps finish first, keeping their blocks valid
                return self._plan([], [], [])  # only closes and rejects, if any
            if (victim := self._preempt()) is None:
                break
            preempted.append(victim)
        opens = self._admit()
        spans = self._spans()
        if not spans and not self.in_flight and self.running and (victim := self._preempt()):
            preempted.append(victim)
            opens += self._admit()
            spans = self._spans()
        return self._plan(opens, spans, preempted)

    def _num_blocks_short(self) -> int:
        """Blocks the decoding rows need for their next token beyond what the pool has."""
        size = self.pool.block_size
        needed = sum(
            1 - self.pool.num_out_of_window(r.tables, r.num_computed)
            for r in self.running.values()
            if not r.is_prefilling
            and not self._is_at_bounds(r)
            and r.num_computed >= len(r.blocks) * size
        )
        return needed - self.pool.num_free_blocks

    def _plan(
        self,
        opens: list[tuple[str, SequenceParams, int]],
        spans: list[PlannedSpan],
        preempted: list[str],
    ) -> StepPlan | None:
        """The step that carries these and the pending closes and rejects; None if empty."""
        if not (opens or spans or self.pending_closes or self.pending_rejects):
            return None
        self.num_steps += 1
        self.in_flight[self.num_steps] = {
            span.request_id: span.start + span.num_new for span in spans
        }
        drops = () if self.snapshots is None else self.snapshots.take_drops(self.pool.by_hash)
        plan = StepPlan(
            step=self.num_steps,
            opens=tuple(opens),
            closes=tuple(self.pending_closes),
            rejects=tuple(self.pending_rejects),
            spans=tuple(spans),
            epoch=self.pool.epoch,
            num_free_blocks=self.pool.num_free_blocks,
            hit_rate=self.pool.hit_rate,
            preempted=tuple(preempted),
            restores=tuple(self.pending_restores),
            snapshot_drops=drops,
        )
        self.pending_closes.clear()
        self.pending_rejects.clear()
        self.pending_restores.clear()
        return plan

    def _is_at_bounds(self, request: ScheduledRequest) -> bool:
        """It may not sample again: at its max_tokens or the context bound."""
        max_tokens = request.params.max_tokens
        return (max_tokens is not None and request.num_samples >= max_tokens) or (
            request.frontier >= self.max_context
        )

    def _awaits_its_sample(self, request: ScheduledRequest) -> bool:
        """A constrained row's next mask needs its queued token: it skips lookahead's
        speculative step (runtime/grammar.py). Inside the thought before its grammar,
        only its second: the engine picks the mask past one on the device."""
        num_collected = len(request.tokens) - len(request.params.prompt_tokens)
        may_fly = 1 if request.is_thinking else 0
        return request.params.grammar is not None and request.num_samples - num_collected > may_fly

    def _admit(self) -> list[tuple[str, SequenceParams, int]]:
        opens = []
        computing = self._prefixes_in_progress()
        index = 0  # the first waiting request not held back
        while index < len(self.waiting) and len(self.running) < self.max_batch:
            request = self.waiting[index]
            # Leave the last known token to compute: its logits give the next token.
            num_lookup = (len(request.tokens) - 1) // self.pool.block_size
            hits = self._usable_hits(request, self.pool.match_tables(request.block_hashes[:num_lookup]))
            num_hit = len(hits[0])
            if self._is_held(request, num_hit, num_lookup, computing):
                index += 1  # its next block will be cached soon: take it from there
                continue
            num_tokens = len(request.tokens) + 1
            # Chunks shrink to the blocks there are (_span_length): only a row that cannot
            # hold one token at a time never fits (past admission when every layer slides).
            if self.pool.blocks_for_row(num_tokens, 1) > self.pool.num_blocks:
                self.waiting.pop(index)
                self.pending_rejects.append((request.request_id, self._too_large(request)))
                continue
            footprint = self._footprint(num_tokens, self._max_chunk)
            needed = footprint - self.pool.num_held(hits)
            if needed + self._committed() > (
                self.pool.num_free_blocks - self.pool.num_evictable_tables(hits)
            ):
                break
            self.waiting.pop(index)
            # A resumed row's lookup is its recompute, not a prompt's: uncounted, as vLLM's.
            num_prompt_tokens = None if request.is_open else len(request.tokens)
            self.pool.take_cached_tables(hits, num_lookup, num_prompt_tokens)
            request.tables = hits
            request.num_computed = request.num_kv_done = num_hit * self.pool.block_size
            request.num_published = num_hit
            if self.snapshots is not None and num_hit:  # its recurrent state starts there
                snapshot = self.snapshots.take(request.block_hashes[num_hit - 1])
                self.pending_restores.append((request.request_id, snapshot))
            if not request.is_open:
                request.is_open = True
                request.num_cached_tokens = request.num_computed
                opens.append((request.request_id, request.params, request.num_computed))
            self.running[request.request_id] = request
            self._note_in_progress(request, computing)
        return opens

    def _prefixes_in_progress(self) -> dict[bytes, int]:
        """Prompt blocks running requests are computing and have not yet cached: each
        block's hash -> the best (lowest) priority among them.

        A waiting request whose next uncached block is one of these is held back until it
        is cached, then admitted as a prefix hit: n choices of one prompt (or requests
        arriving together with a shared system prompt) compute the shared blocks once,
        and each recomputes only its last, partial block. Only behind a request of its
        own priority or better, which gets the step budget first, so holding never
        inverts priorities."""
        computing: dict[bytes, int] = {}
        if self.pool.is_caching and self.waiting:
            for request in self.running.values():
                self._note_in_progress(request, computing)
        return computing

    def _is_held(
        self,
        request: ScheduledRequest,
        num_hits: int,
        num_lookup: int,
        computing: dict[bytes, int],
    ) -> bool:
        """Most of its uncached blocks are being computed by running requests that rank no
        lower. "Most": holding costs the held request at least a step, which pays for a
        whole shared prompt (n choices, a long system prompt) but not for the first block
        or two a chat template gives every prompt (16 clients of distinct 150-token chat
        prompts behind one: 3 held through a 0.54 s step to save 16 tokens each)."""
        end = min(num_lookup, len(request.block_hashes))
        if num_hits >= end:
            return False
        shared = 0
        for block_hash in request.block_hashes[num_hits:end]:
            best = computing.get(block_hash)
            if best is None or best > request.params.priority:
                break
            shared += 1
        return 2 * shared >= end - num_hits

    def _note_in_progress(self, request: ScheduledRequest, computing: dict[bytes, int]) -> None:
        if not self.pool.is_caching:
            return
        priority = request.params.priority
        # A hybrid model's prompt blocks are usable only once the state after them is kept,
        # at the end of the prefill (runtime/kv/snapshots.py): until then, all are pending.
        first = 0 if self.snapshots is not None and request.is_prefilling else request.num_published
        for block_hash in request.block_hashes[first:]:
            computing[block_hash] = min(computing.get(block_hash, priority), priority)

    def _too_large(self, request: ScheduledRequest) -> str:
        capacity = self.pool.num_blocks * self.pool.block_size
        return f"{len(request.tokens)} tokens can never fit the KV pool of {capacity} tokens"

    def _committed(self) -> int:
        """Blocks running requests still need for their known tokens, or one to grow. A
        decoding row computes one token a step: in a window it never again holds a chunk."""
        return sum(
            max(
                self._footprint(r.frontier + 1, self._max_chunk if r.is_prefilling else 1)
                - self.pool.num_held(r.tables),
                1,
            )
            for r in self.running.values()
        )

    def _footprint(self, num_tokens: int, chunk: int) -> int:
        """Blocks a row holds at most in spans of `chunk`; past the pool, chunks shrink."""
        return min(self.pool.blocks_for_row(num_tokens, chunk), self.pool.num_blocks)

    @property
    def _max_chunk(self) -> int:
        """The most tokens one span computes: a windowed group 0 holds its window and that."""
        return max(self.prefill_chunk, self.solo_prefill_tokens)

    def _spans(self) -> list[PlannedSpan]:
        ranked = sorted(self.running.values(), key=lambda r: r.rank)
        decoding = [r for r in ranked if not r.is_prefilling]
        # Within a priority, the prompt with the fewest tokens left goes first: a short
        # prompt's first token waits a step or two, not for the long prompts ahead of
        # it, and equal prompts still finish one by one in arrival order (taking turns
        # would finish them all late together).
        prefilling = sorted(
            (r for r in ranked if r.is_prefilling),
            key=lambda r: (r.params.priority, r.frontier - r.num_computed, r.arrival),
        )
        budget, chunk = self.max_num_batched_tokens, self.prefill_chunk
        if not decoding:  # no stream to stall
            budget, chunk = (
                max(budget, self.solo_prefill_tokens),
                max(chunk, self.solo_prefill_tokens),
            )
        spans = []
        for request in decoding + prefilling:  # decoding rows first: never stalled by a prompt
            num_new = self._span_length(request, budget, chunk)
            if num_new == 0:
                continue
            start, is_prefill = request.num_computed, request.is_prefilling
            save_as = self._planned_save(request, start + num_new, is_prefill)
            request.num_computed += num_new
            samples = request.num_computed == request.frontier
            request.num_samples += samples
            budget -= num_new
            tables = tuple(tuple(table) for table in request.tables)
            spans.append(
                PlannedSpan(
                    request.request_id, start, num_new, tables[0], samples, tables[1:], is_prefill, save_as
                )
            )
        return spans

    def _span_length(self, request: ScheduledRequest, budget: int, chunk: int) -> int:
        """Tokens to give `request` this step (0: none), with the blocks they need taken."""
        if request.is_prefilling:  # a chunk within the step's budget
            num_new = min(chunk, budget, request.frontier - request.num_computed)
            if (point := self._next_save_point(request)) is not None:  # end there, to keep the state
                num_new = min(num_new, point - request.num_computed)
        else:  # decoding: one token, unless that would sample past the request's bounds
            if self._is_at_bounds(request) or self._awaits_its_sample(request):
                return 0
            num_new = 1
        if num_new <= 0:
            return 0
        # Give back what fell out of a window, then take the blocks it needs (in every
        # layer group's table); a chunk shrinks to the blocks there are.
        self.pool.release_out_of_window(request.tables, request.num_computed)
        room = len(request.blocks) * self.pool.block_size - request.num_computed
        missing = self.pool.blocks_for(max(num_new - room, 0))
        # A prompt chunk leaves every row a windowed block for its next token: the windowed
        # pools are sized for 512-token chunks (runtime/kv/layout.py), and a longer chunk
        # taking them all would stall the decoding rows until the prompt was done.
        keep_free = len(self.running) if request.is_prefilling else 0
        missing = min(missing, self.pool.num_growable(request.tables, request.num_computed, keep_free))
        self.pool.grow_tables(request.tables, missing)
        return min(num_new, room + missing * self.pool.block_size)

    def _publish(self, request: ScheduledRequest) -> None:
        """Offer the request's full blocks of known tokens and computed K/V to the cache."""
        size = self.pool.block_size
        num_full = min(request.num_kv_done, len(request.tokens)) // size
        if num_full > len(request.block_hashes):
            parent = request.block_hashes[-1] if request.block_hashes else b""
            start = len(request.block_hashes) * size
            request.block_hashes += chain_hashes(
                request.tokens[: num_full * size], size, self.pool.salt, parent=parent, start=start
            )
        for i in range(request.num_published, num_full):
            self.pool.publish_tables(request.tables, i, request.block_hashes[i])
        request.num_published = max(request.num_published, num_full)

    def _preempt(self) -> str | None:
        """Requeue the lowest-ranked running request by recompute; its id, or None if alone."""
        if len(self.running) < 2:
            return None
        victim = max(self.running.values(), key=lambda r: r.rank)
        request = self.running.pop(victim.request_id)
        self._free(request)
        request.num_computed = request.num_kv_done = request.num_published = 0
        bisect.insort(self.waiting, request, key=lambda r: r.rank)
        self.num_preemptions += 1
        return request.request_id

    def _free(self, request: ScheduledRequest) -> None:
        self.pool.release_tables(request.tables)
        request.tables = self.pool.new_tables()
        if self.snapshots is not None:
            self.snapshots.forget(request.request_id)
