"""The handle of a running model (`open_llm`'s, actors/service.py): `generate()` checks a
request and streams it through the actors, `drain()` stops taking requests and lets the
running ones finish, `engine_stats()` reads the engine's counts on the MLX thread."""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from typing import TYPE_CHECKING, Any

from runtime.errors import RequestError
from runtime.grammar import GrammarSpec
from runtime.sequence import SamplingParams

import attrs
import trio

from actors.generation import Generation
from actors.messages import AbortAll, Admit, SchedulerMessage
from actors.requests import GenerateRequest, ServiceClosedError, check_request, stop_strings

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.scheduler import FcfsScheduler

    from actors.admission import Admission
    from actors.metrics import Metrics
    from actors.mlx_thread import MlxThread

_SAMPLING_FIELDS = tuple(field.name for field in attrs.fields(SamplingParams))


@attrs.frozen
class EngineStats:
    num_open: int  # engine rows
    num_pending: int  # steps queued and not collected
    num_free_blocks: int  # KV blocks free or cached-evictable (the policy's view)
    num_used_blocks: int  # KV blocks held by a running request


class LLM:
    """A running model: `generate()` streams, `drain()` stops taking requests."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        policy: FcfsScheduler,
        thread: MlxThread,
        admission: Admission,
        to_admission: trio.MemorySendChannel[Admit],
        to_scheduler: trio.MemorySendChannel[SchedulerMessage],
        metrics: Metrics,
    ):
        self.name = name  # what /v1/models reports
        self.loaded_at = int(time.time())  # Unix seconds: /v1/models' `created`, as OpenAI's
        self.metrics = metrics  # what /metrics exposes
        self.max_context = engine.max_context
        self.max_batch = engine.max_batch
        self.vocab_size = admission.vocab_size
        self.tool_style = admission.tool_style  # how tool calls read in this model's output
        # The tags chat replies think between (`<think>`, Mistral's `[THINK]`), if any
        self.think_tags = admission.think_tags
        self.thinks = self.think_tags is not None
        self.max_waiting = admission.waiting_slots.value  # all free: nothing admitted yet
        self.is_draining = False
        self.num_active = 0  # generations started and not yet done
        # ... those generations, held weakly: a strong reference here kept one its caller
        # dropped mid-stream (a `break` out of `async for` without `async with`) from
        # ever being collected, so its row ran on to max_tokens or the context's end.
        self._active: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._engine = engine
        self._policy = policy
        self._thread = thread
        self._admission = admission
        self._to_admission = to_admission
        self._to_scheduler = to_scheduler
        self._idle = trio.Event()
        self._idle.set()
        self._is_closed = False
        self.is_aborting_all = False  # AbortAll sent (once is enough): what runs ends now

    def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | tuple[str, ...] | None = (),
        ignore_eos: bool | None = False,
        priority: int | None = 0,
        grammar: GrammarSpec | None = None,
        **sampling: Any,
    ) -> Generation:
        """Stream a completion of `prompt`, or of chat `messages` through the chat template.

        `sampling` takes `runtime.sequence.SamplingParams` fields (temperature, top_p,
        top_k, min_p, seed, penalties, logit_bias as {token_id: bias}, logprobs=N for
        each token's logprob and its N most likely alternatives, 0..20, in
        `Delta.logprobs`); temperature 0 (the default) is greedy. They are checked as
        the HTTP server checks them (top_k -1 is off, None is the default). `grammar`: structured
        output, e.g. `GrammarSpec("json_schema", schema_text, "grammar")` (runtime/grammar.py);
        a grammar that does not compile fails `start()` with RequestError. `priority`: lower values are scheduled first and
        preempted last (vLLM's meaning); equal ones first come, first served.
        Returns a `Generation`: iterate it, ideally inside
        `async with`, so that leaving early aborts the request at once.
        Raises RequestError for a bad argument.
        """
        # Named before the None filter, so that a misspelt field set to None is refused too,
        # and here, so that the message names this call, not SamplingParams.__init__.
        for name in sampling:
            if name not in _SAMPLING_FIELDS:
                raise RequestError(
                    f"generate() got an unexpected keyword argument {name!r}"
                    f" (sampling fields: {', '.join(_SAMPLING_FIELDS)})",
                    param=name,
                )
        # None is the default, as null is over HTTP (and as OpenAI's clients send unset fields).
        given = {name: value for name, value in sampling.items() if value is not None}
        try:
            params = SamplingParams(**given)
        except (TypeError, ValueError) as error:
            # The names are known (above), so a converter refused a value: logit_bias's,
            # the one there is ("logit_bias=5" was a RequestError naming no parameter).
            raise RequestError(f"bad sampling parameter: {error}", param="logit_bias") from None
        request = GenerateRequest(
            prompt=tuple(prompt) if isinstance(prompt, list) else prompt,
            messages=tuple(messages) if isinstance(messages, list) else messages,
            max_tokens=max_tokens,
            sampling=params,
            stop=stop_strings(stop),
            ignore_eos=False if ignore_eos is None else ignore_eos,
            priority=0 if priority is None else priority,
            grammar=grammar,
        )
        return Generation(self, check_request(request))

    @property
    def num_preemptions(self) -> int:
        """Requests requeued by recompute so far because the KV pool was full."""
        return self._policy.num_preemptions

    @property
    def num_waiting(self) -> int:
        """Requests holding a waiting slot: admitted and not yet scheduled, or refused."""
        return self.max_waiting - self._admission.waiting_slots.value

    async def engine_stats(self) -> EngineStats:
        """Row counts read on the MLX thread (the engine is not shared with Trio)."""
        engine, pool = self._engine, self._policy.pool
        num_open, num_pending = await self._thread.run(
            lambda: (engine.num_open, engine.num_pending)
        )
        return EngineStats(num_open, num_pending, pool.num_free_blocks, pool.num_used_blocks)

    async def drain(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running ones finish (abort them after `timeout`), stop."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
            # `timeout >= 0` raised "'>=' not supported between instances of 'str' and 'int'"
            raise TypeError(f"drain timeout must be None or seconds >= 0, got {timeout!r}")
        if timeout is not None and not timeout >= 0:  # NaN too
            raise ValueError(f"drain timeout must be None or seconds >= 0, got {timeout!r}")
        if self._is_closed:
            return
        self._is_closed = self.is_draining = True
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await self._until_idle_or_answered()
            if self.num_active and not self._is_all_answered():
                await self._abort_all()
                # Readers see the abort at once; one that never reads must not hold us up.
                with trio.move_on_after(1.0):
                    await self._idle.wait()
        except BaseException:  # cancelled by the caller's own deadline, or a Ctrl-C
            with trio.CancelScope(shield=True):
                await self._abort_all()
            raise
        finally:  # closed whatever happened: the close cascades down the pipeline,
            self._to_admission.close()  # and open_llm's exit, finding us closed, waits on it
            self._to_scheduler.close()

    async def _abort_all(self) -> None:
        if self.is_aborting_all:
            return
        self.is_aborting_all = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._to_scheduler.send(AbortAll("shutdown"))  # it fits: see _start_actors

    # -- for Generation ------------------------------------------------------------------

    async def _until_idle_or_answered(self) -> None:
        """Until every generation is done, or holds its whole answer unread: a caller
        that started one and never read it (nor closed it) kept drain, and so the end
        of `open_llm`'s block, waiting forever for a request the engine had finished."""
        while self.num_active and not self._is_all_answered():
            with trio.move_on_after(0.05):  # nothing signals "answered": look again
                await self._idle.wait()

    def _is_all_answered(self) -> bool:
        return all(generation.is_answered for generation in self._active)

    def _admit(self, admit: Admit, generation: Generation) -> None:
        if self.is_draining:
            raise ServiceClosedError("the service is shutting down")
        self._admission.reserve()
        try:
            self._to_admission.send_nowait(admit)  # fits: each queued Admit holds a reservation
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._admission.waiting_slots.release()
            raise ServiceClosedError("the service is shutting down") from None
        self.num_active += 1
        self._active.add(generation)
        self._idle = trio.Event() if self.num_active == 1 else self._idle

    def _release(self, generation: Generation) -> None:
        self.num_active -= 1
        self._active.discard(generation)
        if self.num_active == 0:
            self._idle.set()
