"""n choices of one request (OpenAI's `n`): n Generations, admitted together, read as one.

Each choice is a request of its own to the scheduler, so n choices count as n
against `max_waiting` and `max_batch`, and admission takes all n waiting slots at
once or none (a full queue refuses the whole request). They share the prompt's KV
blocks through the prefix cache: the policy holds the later choices until the first
has cached the prompt's full blocks (runtime/scheduler.py), so each of the others
recomputes only its last, partial block.

If one choice fails, the whole request fails and the other choices are aborted:
a response never leaves a choice out.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, TypeAlias

from runtime.errors import CadenceError, RequestError

import attrs
import trio

from actors.generation import Generation
from actors.messages import AdmitGroup
from actors.requests import (
    MIN_SEED,
    Delta,
    GenerateRequest,
    OverloadedError,
    SiblingRefusedError,
    Usage,
)

if TYPE_CHECKING:
    from actors.llm import LLM

DEFAULT_MAX_N = 8

# What one choice's task hands on: a delta, or the error that ended the choice.
ChoiceEvent: TypeAlias = tuple[int, Delta | CadenceError]


def choice_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The n requests: choice i of a seeded request samples with seed + i (wrapping in int64).

    So choice 0 is what the same request with n=1 gives, the choices differ from
    each other, and a repeat of the request repeats every choice (vLLM derives them
    the same way). Unseeded choices draw from the shared generator; greedy ones agree.
    """
    seed = request.sampling.seed
    if seed is None or n == 1:
        return [request] * n
    return [
        attrs.evolve(
            request,
            sampling=attrs.evolve(request.sampling, seed=(seed + i - MIN_SEED) % 2**64 + MIN_SEED),
        )
        for i in range(n)
    ]


async def start_together(llm: LLM, generations: Sequence[Generation]) -> None:
    """Admit every choice or none.

    Raises OverloadedError when fewer waiting slots are free than there are choices
    (the slots are taken in one go, with no await between them), and whatever a
    choice's admission raises (a bad prompt, draining): the others are refused with
    it before any reaches the scheduler (AdmitGroup), so none runs a step.
    """
    if len(generations) > llm.max_waiting:  # would never fit: retrying cannot help
        raise RequestError(
            f"n={len(generations)} is more than this server queues ({llm.max_waiting})",
            param="n",
        )
    if len(generations) > llm.max_waiting - llm.num_waiting:
        raise OverloadedError("the server is at capacity; retry shortly")
    group = AdmitGroup(len(generations)) if len(generations) > 1 else None
    refusals: list[CadenceError] = []
    try:
        for generation in generations:
            generation.submit(group)
        for generation in generations:
            try:
                await generation.start()
            except CadenceError as error:
                refusals.append(error)
    except BaseException:  # a submit refused (draining), or cancelled: none waits for the rest
        if group is not None:
            group.refuse()
        for generation in generations:
            await generation.aclose(generation.cancel_cause)
        raise
    if refusals:
        for generation in generations:
            await generation.aclose()
        # The refusal of its own, not the ones it caused (their choice is named for it).
        raise next((e for e in refusals if not isinstance(e, SiblingRefusedError)), refusals[0])


@contextlib.asynccontextmanager
async def interleaved(
    generations: Sequence[Generation],
) -> AsyncIterator[trio.MemoryReceiveChannel[ChoiceEvent]]:
    """The choices' deltas as they come, each with its choice's index.

    A choice that fails sends its error and stops. Leaving the block, early or on
    cancellation (a client that disconnects), aborts every choice still running, at
    once: their rows leave the batch within a step.
    """
    send, receive = trio.open_memory_channel[ChoiceEvent](0)
    try:
        async with trio.open_nursery() as nursery:
            for index, generation in enumerate(generations):
                nursery.start_soon(_forward, index, generation, send.clone())
            send.close()
            try:
                yield receive
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for generation in generations:
            await generation.aclose("disconnected")


async def _forward(
    index: int, generation: Generation, send: trio.MemorySendChannel[ChoiceEvent]
) -> None:
    async with send:
        try:
            async for delta in generation:
                await send.send((index, delta))
        except CadenceError as error:
            await send.send((index, error))


def combined_usage(usages: Sequence[Usage], n: int) -> Usage:
    """One response's usage, from its choices' in index order, n to a prompt: each
    prompt counted once (as OpenAI does), the completions summed; a prompt's cached
    tokens are the fewest any of its choices took from the cache, so sharing the prompt
    among the choices does not count as reuse."""
    prompts = [usages[i : i + n] for i in range(0, len(usages), n)]
    return Usage(
        prompt_tokens=sum(choices[0].prompt_tokens for choices in prompts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(min(u.cached_tokens for u in choices) for choices in prompts),
    )
