"""Admission: reserve a waiting slot, tokenize off the event loop, check the context, submit.

The reservation is a token of `waiting_slots` (a trio.Semaphore of `max_waiting`),
taken by the caller with `reserve()` before anything is queued: when none is left
the caller gets OverloadedError at once. The token passes to the scheduler with the
Submit, which returns it when the request gets a batch row or leaves the queue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.command_r7b_reply import ACTION_TAGS
from runtime.errors import CadenceError, RequestError
from runtime.gemma4_reply import CALL_CLOSE, CALL_OPEN, QUOTE
from runtime.glm45_reply import GLM45_TAGS
from runtime.grammar import (
    JSON_KINDS,
    CompiledGrammar,
    GrammarCompiler,
    GrammarSpec,
    ThoughtFirst,
    shapes_content_only,
)
from runtime.harmony import HARMONY_HEADER
from runtime.sequence import SequenceParams, check_sequence
from runtime.think_reply import ThinkTags, prompt_closes_thought, prompt_opens_thought
from runtime.tokenizer import Tokenizer
from runtime.tool_grammars import tool_call_grammar
from runtime.tool_prompts import (
    arguments_of_no_object,
    chat_for_template,
    template_knows_tools,
    tools_for_template,
    with_object_arguments,
)
from runtime.tools import (
    ARGS,
    GRANITE_TOOL_CALL,
    HERMES_TAGS,
    LFM2_TAGS,
    NEMOTRON_TAGS,
    OLMO3_TAGS,
    REASONING_STYLES,
    SEED_TAGS,
    TOOL_CALLS,
)

import attrs
import structlog
import trio

from actors.messages import (
    Abort,
    Accepted,
    AdmissionClosed,
    Admit,
    Rejected,
    SchedulerMessage,
    StreamerMessage,
    Submit,
    Track,
)
from actors.metrics import Metrics
from actors.requests import GenerateRequest, OverloadedError, SiblingRefusedError

log = structlog.get_logger("cadence.admission")

# How long a request's grammar may wait for the compile thread (then a 503), and then
# take to compile (then a 400). llguidance's own limits (runtime/grammar.py) stop the
# work itself; this bounds the wait.
GRAMMAR_TIMEOUT_S = 5.0
# Compiles run on threads of their own, one at a time: a thread past the deadline is
# abandoned but runs on (a 240 KB schema took 10-24 s in llguidance), and on trio's
# shared limiter forty such threads held every worker, so plain requests waited in
# `prepare` for 20 s. Now they cost one core at most, and no other request's admission.
COMPILE_THREADS = 1
# Prompts render and tokenize on threads of their own too, two at a time: a 4 MB prompt
# takes ~3 s, and a caller that leaves meanwhile has its slot back at once (its thread
# abandoned, finishing in the background), so a burst of such callers costs two cores
# for a while, not every waiting slot. How often a preparing request's caller is asked
# after:
PREPARE_THREADS = 2
CALLER_POLL_S = 0.1


@attrs.define
class Admission:
    tokenizer: Tokenizer
    max_context: int
    vocab_size: int
    kv_tokens: int | None
    inbox: trio.MemoryReceiveChannel[Admit]
    to_scheduler: trio.MemorySendChannel[SchedulerMessage]
    to_streamer: trio.MemorySendChannel[StreamerMessage]
    waiting_slots: trio.Semaphore
    grammars: GrammarCompiler | None = None  # None: structured output is refused
    tool_style: str = "hermes"  # the call format the model writes (runtime/tools.py)
    compile_threads: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(COMPILE_THREADS)
    )
    metrics: Metrics | None = None  # counts the requests whose caller left during admission
    prepare_threads: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(PREPARE_THREADS)
    )
    # The tags (`<think>`, Mistral's `[THINK]`) a model's chat replies think between
    # (runtime/think_reply.py); None: not such a model, or their split is off.
    think_tags: ThinkTags | None = None

    def reserve(self) -> None:
        """Take a waiting slot now or raise OverloadedError; never waits."""
        try:
            self.waiting_slots.acquire_nowait()
        except trio.WouldBlock:
            raise OverloadedError("the server is at capacity; retry shortly") from None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox, self.to_scheduler, self.to_streamer:  # sync close: see Streamer.run
            async with trio.open_nursery() as nursery:
                task_status.started()
                async for admit in self.inbox:
                    # At most `max_waiting` of these at once: each holds a reservation.
                    nursery.start_soon(self._admit, admit)
            await self.to_scheduler.send(AdmissionClosed())

    async def _admit(self, admit: Admit) -> None:
        bound = log.bind(request_id=admit.request_id)
        try:
            params = await self._prepare_while_awaited(admit)
            if params is not None and (spec := self.grammar_spec(admit.request)) is not None:
                params = attrs.evolve(
                    params,
                    grammar=await self._compile(self._after_text_thought(admit.request, params, spec)),
                    thought_first=self._thought_first(admit.request, params),
                )
        except Exception as error:
            if not isinstance(error, CadenceError):  # a tokenizer or template bug: this request only
                bound.exception("prepare failed")
                error = RequestError(f"could not prepare the prompt: {error}")
            self._refuse(admit, error)
            return
        # Its siblings (n choices, a batch of prompts) prepared too, or one was refused.
        is_refused_with = (
            params is not None and admit.group is not None and not await admit.group.all_ready()
        )
        if params is None or _caller_left(admit):
            if admit.group is not None:
                admit.group.refuse()
            self.waiting_slots.release()
            # Its one end event, as the streamer logs a request aborted later (a client
            # that half-closes its socket after sending is gone by now).
            if self.metrics is not None:
                self.metrics.on_aborted()
            bound.info("aborted", cause="disconnected", stage="admission")
            return
        if is_refused_with:
            self._refuse(admit, SiblingRefusedError("another request admitted with it was refused"))
            return
        num_prompt_tokens = len(params.prompt_tokens)
        # Track before Submit: the streamer must know the request before its first token.
        await self.to_streamer.send(
            Track(
                admit.request_id,
                admit.reply,
                admit.request.stop,
                num_prompt_tokens,
                admit.arrived_at,
                keep_special_tokens=self.keeps_control_tokens(admit.request),
                thinks=self.thinks(admit.request),
                opening=self._opening(admit.request, params),
            )
        )
        await self.to_scheduler.send(Submit(admit.request_id, params))
        bound.info("admitted", prompt_tokens=num_prompt_tokens, max_tokens=params.max_tokens)
        # Accepted goes last, so a caller that aborts after seeing it aborts after the Submit.
        try:
            admit.reply.send_nowait(Accepted(admit.request_id, num_prompt_tokens))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.to_scheduler.send(Abort(admit.request_id, "cancelled"))

    def _refuse(self, admit: Admit, error: CadenceError) -> None:
        """Give its slot back and answer Rejected; the rest of its group are refused too."""
        if admit.group is not None:
            admit.group.refuse()
        self.waiting_slots.release()
        bound = log.bind(request_id=admit.request_id)
        if isinstance(error, RequestError):
            bound.info("rejected", code=error.code, param=error.param, error=str(error))
        elif not isinstance(error, OverloadedError):  # its caller logs a refusal for load
            bound.info("rejected", error=str(error))
        _reply_and_close(admit, Rejected(admit.request_id, error))

    async def _prepare_while_awaited(self, admit: Admit) -> SequenceParams | None:
        """`prepare` on a worker thread, or None as soon as the caller leaves (its
        thread abandoned: it cannot be stopped)."""
        params, failure = None, None
        async with trio.open_nursery() as nursery:

            async def cancel_when_the_caller_leaves() -> None:
                while not _caller_left(admit):
                    await trio.sleep(CALLER_POLL_S)
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_the_caller_leaves)
            try:
                params = await trio.to_thread.run_sync(
                    self.prepare,
                    admit.request,
                    admit.request_id,
                    limiter=self.prepare_threads,
                    abandon_on_cancel=True,
                )
            except Exception as error:  # raised past the nursery, not in an ExceptionGroup
                failure = error
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return params

    def keeps_control_tokens(self, request: GenerateRequest) -> bool:
        """Whether the request's text keeps the control tokens decoding drops, for the
        parser (as vLLM does): Mistral's models call tools in them (kept where tools
        are offered), as Granite 3's (`<|tool_call|>`) and LFM2's (`<|tool_call_start|>`) do and OLMo 3's may (its
        `<function_calls>` tags), and gpt-oss marks every message of its chat replies
        with them. Hermes's `<tool_call>` tags are plain added tokens in Qwen's tokenizers
        but control tokens in Granite 4.0's: kept where they are (as vLLM's hermes parser),
        as GLM-4.5's `<tool_call>` and `<arg_key>` tags would be (plain added tokens in GLM's),
        and Seed-OSS's `<seed:tool_call>` tags are (special tokens in its tokenizer). Command
        R7B's calls are between control tokens, and its answer too (the parser drops those)."""
        if self.tool_style in REASONING_STYLES:
            return request.messages is not None
        own_tags = {"hermes": HERMES_TAGS, "glm45": GLM45_TAGS, "seed_oss": SEED_TAGS}.get(self.tool_style, ())
        calls_in_control_tokens = self.tool_style in ("mistral", "olmo3", "granite", "lfm2", "nemotron", "command_r7b") or (
            not set(own_tags).isdisjoint(self.tokenizer.control_spellings.values())
        )
        return calls_in_control_tokens and bool(request.tools) and request.tool_choice != "none"

    def thinks(self, request: GenerateRequest) -> bool:
        """Whether the request's reply is a chat reply that may think in the model's tags
        (Granite's only where the request turns its thinking on)."""
        if self.think_tags is None or request.messages is None:
            return False
        return self.think_tags.thinks_with(dict(request.chat_template_kwargs))

    def _opens_thought(self, request: GenerateRequest, params: SequenceParams) -> bool:
        """Whether the reply starts inside a thought the prompt opened (QwQ's and
        DeepSeek-R1's templates end in `<think>` and a newline; Mistral's never), a
        grammar or not: one shapes what follows the thought (`_thought_first`)."""
        if self.think_tags is None or not self.thinks(request):
            return False
        return prompt_opens_thought(params.prompt_tokens, self.think_tags, self._spelled)

    def _opening(self, request: GenerateRequest, params: SequenceParams) -> str:
        """The opening tag the prompt left open, which the reply's text begins with."""
        if self.think_tags is None or not self._opens_thought(request, params):
            return ""
        return self.think_tags.open

    def _spelled(self, ids: list[int]) -> str:
        """`ids` as text, special tokens spelled out (a thought's tags may be special)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _thought_first(self, request: GenerateRequest, params: SequenceParams) -> ThoughtFirst | None:
        """For a chat reply that thinks in the model's tags, the grammar (`response_format`,
        the guided fields, a forced call) waits for the thought to end, as vLLM's and
        SGLang's with a reasoning parser: shaped from its first token, a QwQ reply would
        answer inside the thought its prompt opened, and a Qwen3 reply could not think.
        None where the template closed an empty thought (Qwen3's `enable_thinking:
        false`): the reply answers at once, shaped from its first token. None too where
        the tags are text (OLMo 3 Think's): no one token closes the thought to switch
        on, so the grammar holds the thought itself (`_after_text_thought`)."""
        if self.think_tags is None or self.think_tags.ids is None or not self.thinks(request):
            return None
        if prompt_closes_thought(params.prompt_tokens, self.think_tags, self._spelled):
            return None
        return ThoughtFirst(*self.think_tags.ids, is_open=self._opens_thought(request, params))

    def _after_text_thought(
        self, request: GenerateRequest, params: SequenceParams, spec: GrammarSpec
    ) -> GrammarSpec:
        """For a chat reply that thinks in text tags (OLMo 3 Think's), `spec` past the
        thought, written into the grammar: free text up to `</think>`, then the answer
        it shapes (runtime/grammar.py). As it is where the prompt closed the thought."""
        tags = self.think_tags
        if tags is None or tags.ids is not None or not self.thinks(request):
            return spec
        if prompt_closes_thought(params.prompt_tokens, tags, self._spelled):
            return spec
        return attrs.evolve(spec, after_thought=(tags.open, tags.close, self._opens_thought(request, params)))

    def grammar_spec(self, request: GenerateRequest) -> GrammarSpec | None:
        """What the output must match: the request's grammar, or a forced tool call (which
        has no content for a `response_format` to shape), or under `auto` a call or the
        JSON answer (a `response_format` shapes the content, and tools stay callable;
        vLLM's guided fields hold the whole reply, so no call can start beside them).

        Not in Llama 3's format: its calls are bare JSON objects, which the parser
        would read an answer starting with a "name" key as; there the answer alone. Nor
        in harmony's, whose answer would need a final channel's header; an answer with
        no header is content to its parser (runtime/harmony.py), so there too."""
        if request.tool_choice in ("required", "function"):
            return tool_call_grammar(
                self.tool_style, request.tools, request.tool_name, control_tokens=self.control_tokens()
            )
        answer = request.grammar
        if (
            request.tools
            and request.tool_choice == "auto"
            and answer is not None
            and shapes_content_only(answer)
            and answer.kind in JSON_KINDS
            and self.tool_style not in ("llama3_json", *REASONING_STYLES)
        ):
            return tool_call_grammar(
                self.tool_style, request.tools, None, answer, control_tokens=self.control_tokens()
            )
        return answer

    def control_tokens(self) -> dict[str, int]:
        """The call markers (Mistral's, harmony's header markers, the `<tool_call>` tags of
        Hermes, Qwen3-Coder and GLM-4.5 (and its key and value tags), Seed-OSS's `<seed:tool_call>` tags, OLMo 3's `<function_calls>` tags, Granite's `<|tool_call|>`,
        LFM2's `<|tool_call_start|>` and `<|tool_call_end|>`, Command R7B's action tokens)
        that this tokenizer holds as tokens of their own, by spelling: a forced call's
        grammar writes them so (llguidance matches no added token against literal text)."""
        markers = {
            "harmony": HARMONY_HEADER,
            "gemma4": (CALL_OPEN, CALL_CLOSE, QUOTE),
            "hermes": HERMES_TAGS,
            "qwen3_coder": HERMES_TAGS,
            "seed_oss": SEED_TAGS,
            "glm45": GLM45_TAGS,
            "olmo3": OLMO3_TAGS,
            "granite": (GRANITE_TOOL_CALL,),
            "lfm2": LFM2_TAGS,
            "nemotron": NEMOTRON_TAGS,
            "command_r7b": ACTION_TAGS,
        }.get(self.tool_style, (TOOL_CALLS, ARGS))
        spelled = {marker: self.tokenizer.added_token_id(marker) for marker in markers}
        return {marker: token_id for marker, token_id in spelled.items() if token_id is not None}

    async def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammars = self.grammars
        if grammars is None:
            raise RequestError(
                f"'{spec.param}': structured output is not available", param=spec.param
            )
        scope = trio.CancelScope(deadline=trio.current_time() + GRAMMAR_TIMEOUT_S)
        started = False

        def start_the_clock() -> None:  # on the Trio thread, as the compile begins
            nonlocal started
            started = True
            scope.deadline = trio.current_time() + GRAMMAR_TIMEOUT_S

        def compile_grammar() -> CompiledGrammar:
            # The wait for the thread is the server's: the grammar's own time starts here.
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(start_the_clock)
            return grammars.compile(spec)

        with scope:
            # A thread cannot be cancelled: past the deadline it is abandoned, and finishes
            # within llguidance's limits, holding its compile thread until then.
            return await trio.to_thread.run_sync(
                compile_grammar, limiter=self.compile_threads, abandon_on_cancel=True
            )
        if not started:  # other requests' grammars held the compile thread throughout
            raise OverloadedError(f"'{spec.param}': the grammar compiler is busy; retry shortly")
        raise RequestError(
            f"'{spec.param}' took longer than {GRAMMAR_TIMEOUT_S:g} s to compile", param=spec.param
        )

    def prepare(self, request: GenerateRequest, request_id: str) -> SequenceParams:
        """Render, tokenize and size the request (runs on a worker thread: no MLX here)."""
        if request.messages is not None:
            tools = request.tools if request.tool_choice != "none" else ()
            # A checkpoint may name a template of its own for a chat with tools (`tool_use`).
            source = (
                self.tokenizer.tool_use_template_source
                if tools
                else self.tokenizer.chat_template_source
            )

            def encode_chat(messages: Sequence[Mapping[str, Any]]) -> list[int]:
                return self.tokenizer.encode_chat(
                    chat_for_template(messages, tools, self.tool_style, template_knows_tools(source)),
                    template_kwargs=dict(request.chat_template_kwargs),
                    tools=tools_for_template(tools) or None,
                )

            try:
                tokens = encode_chat(request.messages)
            except RequestError as error:
                if (named := _arguments_error(request.messages, encode_chat)) is None:
                    raise
                raise named from error
            field = "messages"
        elif isinstance(request.prompt, str):
            tokens = self.tokenizer.encode(request.prompt)
            field = "prompt"
        else:
            tokens = list(request.prompt or ())
            field = "prompt"
        max_tokens = request.max_tokens  # None: until EOS, a stop, or the context is full
        if max_tokens is None and request.default_max_tokens is not None:
            room = self.max_context - len(tokens)  # none left: check_sequence names the prompt
            max_tokens = min(request.default_max_tokens, room) if room >= 1 else None
        params = SequenceParams(
            prompt_tokens=tuple(tokens),
            max_tokens=max_tokens,
            sampling=request.sampling,
            ignore_eos=request.ignore_eos,
            request_id=request_id,
            priority=request.priority,
        )
        check_sequence(
            params,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            prompt_field=field,
            max_tokens_field=request.max_tokens_field,
            kv_tokens=self.kv_tokens,
        )
        return params


def _arguments_error(
    messages: Sequence[Mapping[str, Any]], encode_chat: Callable[[Sequence[Mapping[str, Any]]], list[int]]
) -> RequestError | None:
    """The chat template refused `messages`: a 400 naming the past call's arguments
    where they are no JSON object's text and the chat renders with objects there.
    Templates that read them as a mapping (Qwen3-Coder's, GLM-4.5's, Seed-OSS's, OLMo
    3's, Gemma 4's) refused in their own words ("Can only get item pairs from a
    mapping"), naming no message; others write such text as it was sent."""
    where = arguments_of_no_object(messages)
    if where is None:
        return None
    try:
        encode_chat(with_object_arguments(messages))
    except RequestError:
        return None  # refused for something else too: the template's own words stand
    return RequestError(
        f"{where} must be a JSON object's text: this model's chat template reads a past call's arguments as one",
        param=where,
    )


def _caller_left(admit: Admit) -> bool:
    return admit.reply.statistics().open_receive_channels == 0


def _reply_and_close(admit: Admit, message: Rejected) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        admit.reply.send_nowait(message)  # unless the caller already left
    admit.reply.close()
