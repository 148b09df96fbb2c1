"""Structured output: grammars compiled with llguidance, and per-row token masks.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)   # once per model
    grammar = compiler.compile(GrammarSpec("json_schema", schema_text, "response_format"))
    state = grammar.start()                                      # once per row
    allowed = token_masks([state, None, ...], vocab_size)        # [B, V] bool, each step
                                                  # (runtime/grammar_masks.py)
    state.advance(token)                                         # each collected token

A row's mask for step N+1 needs its token of step N on the host, while the engine
queues step N+1 before it reads step N (lookahead). Constrained rows therefore skip
the speculative step: the scheduler plans no span for a constrained row whose sample
is still in flight (runtime/scheduler.py), so when the engine samples it, its state
is current. Unconstrained rows keep the lookahead; a constrained row decodes every
other step at lookahead 1, and never forces a batch of its own.

A thinking model's chat reply (`<think>`, Mistral's `[THINK]`; runtime/think_reply.py)
thinks before the grammar shapes its answer (`ThoughtFirst`, as vLLM and SGLang do with
a reasoning parser): the thought is free but for EOS, which it may not end the reply
on; the closing tag (`</think>`, `[/THINK]`) starts the grammar, a few blank tokens
(the model's "\n\n") allowed before it. Where the prompt did not open the thought, the
first token may open one or start the grammar. Inside the thought a row keeps the
lookahead: its next mask depends on its queued token only through whether it is the
closing tag, and the mask past that tag is known before it is drawn (the grammar has
not moved), so it may be fed one queued sample, its mask picked on the device from the
two (`token_masks`). Once its host state is past the thought it is constrained as any
other row.

OLMo 3 Think's tags are text, so no one token closes its thought: there the thought is
written into the grammar (`GrammarSpec.after_thought`): free text up to the first
`</think>`, a few blanks, then the answer's grammar. Such a row is constrained from its
first token, so its thought decodes without the lookahead, and as text: valid UTF-8, no
special token.

Compiling is bounded three ways: llguidance's parser limits cap the work a grammar may
take (lexer fuel, grammar size), the caller gives up waiting after a deadline, and
admission compiles on one thread of its own (actors/admission.py), so the work that
runs on past a deadline holds up only other grammars. llguidance's compiler recurses
along a chain of rules or `$ref`s before its limits are checked, and a chain of 3,000
(a 70 kB `guided_grammar`, a 200 kB `json_schema`) overflowed a thread's 8 MB stack:
a segmentation fault that ended the server. So a grammar is compiled on a thread of
COMPILE_STACK_BYTES, and one defining more than MAX_RULES rules and terminals or
MAX_REFS `$ref`s (the links such a chain needs) is refused before it is compiled.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from runtime.errors import RequestError
from runtime.tokenizer import Tokenizer

import attrs
import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "choice")

# Tighter than llguidance's defaults (1M lexer fuel, 500k symbols): a schema that needs
# more is refused at compile time, in well under a second, instead of stalling a step.
_LEXER_FUEL, _MAX_GRAMMAR_SIZE = 400_000, 100_000
# A compile's stack (reserved, not committed, until used), and the Lark rules and
# terminals, and the `$ref`s, a grammar may define. Measured, a chain takes up to 4 kB
# of stack a rule and 16 kB a $ref (of objects nested in each link): 10,000 and 2,000,
# under 100 MB together. Past what real grammars define: a forced call of 128 tools of
# 10 parameters each is 2,700 rules (OLMo 3's, LFM2's, Gemma 4's). (15,000 rules of
# alternatives ran on past 200 s; 10,000 were refused by llguidance in a second.)
COMPILE_STACK_BYTES = 256 << 20
MAX_RULES, MAX_REFS = 10_000, 2_000
# A Lark rule or terminal's definition ("?name.2:" at a line's start), and a JSON
# schema's reference (a schema's own text, or one embedded in Lark by %json).
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:", re.MULTILINE)
_REFERENCE = '"$ref"'
# Refused grammars remembered per model (GrammarCompiler.compile).
REFUSALS_KEPT = 64
# No free whitespace in generated JSON: the separators are fixed, so a model cannot spend
# its max_tokens on blanks (random and small models do) and the output stays compact.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Blank tokens a thought's end may be followed by before the grammar (which, for JSON,
# takes none): Qwen3 writes "\n\n", one token or two.
BLANKS_AFTER_THOUGHT = 4
TEXT_BLANKS_AFTER_THOUGHT = 8  # the same past text tags, in characters


@attrs.frozen
class GrammarSpec:
    """What a request asked the output to match, as text.

    `kind` is one of GRAMMAR_KINDS: `json_schema` (source: the schema as JSON),
    `json_object` (any JSON object; source ignored), `regex`, `lark` (llguidance's Lark
    dialect, which can embed `%json{...}` schemas), `choice` (source: a JSON list of
    strings). `param` names the request field it came from, for errors.
    """

    kind: str
    source: str
    param: str
    # Text tags (OLMo 3 Think's) the answer follows a thought in, and whether the prompt
    # opened it: the thought is written into the grammar (`_after_text_thought`), as no
    # one token closes it for `ThoughtFirst` to switch on. None: the grammar alone.
    after_thought: tuple[str, str, bool] | None = None

    def llguidance_grammar(self) -> str:
        """llguidance's grammar text; raises RequestError when `source` is not of `kind`."""
        grammar = self._own_grammar()
        return grammar if self.after_thought is None else _after_text_thought(grammar, *self.after_thought)

    def _own_grammar(self) -> str:
        match self.kind:
            case "json_schema":
                # A boolean schema: llguidance applies its options to objects only. `true`
                # admits any JSON, as `{}` does; `false` admits nothing.
                boolean = str(self.source).strip()  # str(): an embedder may pass anything
                if boolean == "false":
                    raise ValueError("the schema `false` admits no value")
                return llguidance.LLMatcher.grammar_from_json_schema(
                    "{}" if boolean == "true" else self.source,
                    overrides=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}',
                    overrides=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            case "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.source)
            case "choice":
                # One terminal (a lexer regex) of the alternatives: as parser alternatives,
                # 2,000 and more were refused ("Current row has 2001 items; max is 2000").
                choices = json.loads(self.source)
                lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(str(c)) for c in choices)
                return llguidance.LLMatcher.grammar_from_lark(lark)
        raise RequestError(f"unknown grammar kind {self.kind!r}", param=self.param)


def _after_text_thought(grammar: str, opening: str, closing: str, is_open: bool) -> str:
    """`grammar` (llguidance's, of one grammar) past a thought in text tags: free text
    up to the first `closing` (a lazy lexeme: the thought ends there), at most a few
    blanks (the "\\n\\n" a model writes there), then `grammar`. Where the prompt opened
    no thought, the reply may open one with `opening` or answer at once."""
    # llguidance's JSON form, or (from grammar_from_lark) Lark's text, which cannot begin with "{"
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    answers = top.get("grammars") or []
    if len(answers) != 1:
        raise ValueError("a grammar past a thought must be one grammar")
    head = "thought BLANKS" if is_open else f"({json.dumps(opening)} thought BLANKS)?"
    lark = (
        f"start: {head} @answer\n"
        f"thought[suffix={json.dumps(closing)}]: /(?s:.*)/\n"
        f"BLANKS: /[ \\t\\r\\n]{{0,{TEXT_BLANKS_AFTER_THOUGHT}}}/\n"
    )
    top["grammars"] = [{"lark_grammar": lark}, {**answers[0], "name": "answer"}]
    return json.dumps(top)


JSON_KINDS = ("json_schema", "json_object")


def shapes_content_only(spec: GrammarSpec) -> bool:
    """OpenAI's `response_format` shapes a reply's content, and tools stay callable
    beside it; every other grammar (vLLM's guided fields, the embedding API's) holds the
    whole reply, which then has no room for a call."""
    return spec.param.startswith("response_format")


def answer_json_schema(spec: GrammarSpec) -> dict[str, Any]:
    """The JSON schema of a `JSON_KINDS` spec, as an object to embed (`%json`) in a
    larger grammar; raises RequestError naming `spec.param` for a schema that is not one."""
    assert spec.kind in JSON_KINDS
    if spec.kind == "json_object":
        return {"type": "object"}
    try:
        schema = json.loads(str(spec.source))
    except ValueError:
        raise RequestError(f"'{spec.param}' is not valid JSON", param=spec.param) from None
    if schema is True:  # as `{}`: llguidance applies its options to objects only
        return {}
    if not isinstance(schema, dict):
        raise RequestError(f"'{spec.param}' must be a JSON schema object", param=spec.param)
    return schema


@attrs.frozen
class ThoughtFirst:
    """A thinking model's chat reply: its grammar shapes what follows the thought (the
    tags' ids: `<think>`'s and `</think>`'s, or Mistral's `[THINK]`'s and `[/THINK]`'s).
    `is_open`: the prompt opened the thought (QwQ's and R1's templates), so the reply
    starts inside it; else its first token may open one."""

    open_id: int
    close_id: int
    is_open: bool


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A grammar checked against the tokenizer; `start()` gives each row its own state."""

    spec: GrammarSpec
    prototype: llguidance.LLMatcher  # never advanced: rows advance deep copies
    mask_vocab: int  # the ids its masks cover (GrammarCompiler.mask_vocab)
    eos_ids: frozenset[int] = frozenset()  # the model's: a thought may not end on one
    blank_ids: tuple[int, ...] = ()  # tokens of blanks alone (BLANKS_AFTER_THOUGHT)

    def start(
        self, barred_eos_ids: frozenset[int] = frozenset(), thought: ThoughtFirst | None = None
    ) -> GrammarState:
        """`barred_eos_ids`: a row that ignores EOS (`ignore_eos`) bars them while its
        grammar allows anything else, or an EOS the grammar allows would end it.
        `thought`: the grammar waits for the reply's thought to end."""
        phase = "grammar" if thought is None else "thought" if thought.is_open else "may_think"
        return GrammarState(
            self.prototype.deep_copy(), self.mask_vocab, barred_eos_ids, thought, phase, self
        )


@attrs.define
class GrammarState:
    """One row's position in its grammar, or in the thought before it (`ThoughtFirst`)."""

    matcher: llguidance.LLMatcher
    mask_vocab: int
    barred_eos_ids: frozenset[int] = frozenset()
    thought: ThoughtFirst | None = None
    # grammar: the grammar shapes each token | may_think: the first, which may open a
    # thought instead | thought: free but for EOS, until the closing tag | blanks: past it,
    # blank tokens (BLANKS_AFTER_THOUGHT at most) or the grammar's first.
    phase: str = "grammar"
    compiled: CompiledGrammar | None = None  # its eos_ids and blank_ids
    num_blanks: int = 0

    def advance(self, token: int) -> str | None:
        """Take a sampled token; an error message when the grammar cannot (never under its mask)."""
        thought = self.thought
        if thought is not None and self.phase != "grammar":
            if self.phase == "thought":
                if token == thought.close_id:
                    self.phase = "blanks"
                return None
            # A grammar that writes the tag itself (one of the thought) takes it.
            if self.phase == "may_think" and token == thought.open_id and not self._takes(token):
                self.phase = "thought"
                return None
            if self.phase == "blanks" and not self._takes(token) and self._is_blank(token):
                self.num_blanks += 1
                if self.num_blanks >= BLANKS_AFTER_THOUGHT:
                    self.phase = "grammar"
                return None
            self.phase = "grammar"
        if self.matcher.consume_token(token):
            return None
        return f"the structured-output grammar refused token {token}: {_reason(self.matcher)}"

    def _takes(self, token: int) -> bool:
        return bool(self.matcher.validate_tokens([token]))

    def _is_blank(self, token: int) -> bool:
        return self.compiled is not None and token in self.compiled.blank_ids

    def fill_mask(self, allowed: np.ndarray) -> None:
        """Widen one row's mask (its grammar's) by what the phase allows besides: the
        tag that opens a thought, the blanks past one, or all but EOS inside it."""
        thought, compiled = self.thought, self.compiled
        if thought is None or compiled is None or self.phase == "grammar":
            return
        vocab = allowed.shape[0]
        if self.phase == "thought":
            allowed[:] = True
            # Unless max_tokens cuts it, the reply does not end before it answers.
            bar_eos(allowed, [t for t in sorted(compiled.eos_ids) if t < vocab])
            return
        extra = (thought.open_id,) if self.phase == "may_think" else compiled.blank_ids
        allowed[[t for t in extra if t < vocab]] = True

    @property
    def is_done(self) -> bool:
        """The grammar is complete and can take no more (EOS aside): the row ends here."""
        return self.phase == "grammar" and self.matcher.is_stopped()

    @property
    def is_thinking(self) -> bool:
        """Inside the thought: the next mask needs no token of it but whether the last
        was `</think>`, so the row may be fed its queued sample (`token_masks`)."""
        return self.phase == "thought"

    def past_thought(self) -> GrammarState:
        """The state `</think>` takes a thinking row to, for its mask alone: it shares
        the matcher, which the thought never advances (nor does this)."""
        assert self.is_thinking
        ahead = attrs.evolve(self)
        ahead.advance(self.close_id)
        return ahead

    @property
    def close_id(self) -> int:
        """`</think>`'s id (a row with a thought)."""
        assert self.thought is not None
        return self.thought.close_id


class GrammarCompiler:
    """Compiles grammars for one model; thread-safe, so admission's workers share it.

    llguidance's view of the tokenizer is built on the first compile (it takes about a
    second for a 150k vocabulary), so a server that never sees a grammar never pays.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self.vocab_size = vocab_size  # the model's: its logits' width
        self.mask_vocab = vocab_size  # at least; set with llguidance's tokenizer (below)
        self._source = tokenizer
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._built: llguidance.LLTokenizer | None = None
        self._cache_lock = threading.Lock()
        self._refusals: OrderedDict[tuple[str, str, tuple[str, str, bool] | None], str] = OrderedDict()
        self._blank_ids: tuple[int, ...] | None = None

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                # The tokenizer may hold ids past the model's rows (Gemma 3 1B's has
                # <image_soft_token> at 262,144, its model 262,144 rows): llguidance
                # refuses a vocabulary smaller than the tokenizer's, so its masks cover
                # both, and are cut to the model's (a token without a row is never drawn).
                self.mask_vocab = max(self.vocab_size, self._source.highest_token_id + 1)
                self._built = llguidance.LLTokenizer(
                    self._source.backend_json(), n_vocab=self.mask_vocab, eos_token=self._eos_ids
                )
            return self._built

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises RequestError naming `spec.param` for a grammar that is malformed or too large.

        The last REFUSALS_KEPT refusals are kept, so a large grammar sent again is
        refused at once. Grammars that compile are not: the copies of one matcher share
        its lexer and the lexer's limits (llguidance), so one reply that used them up
        failed every later request's grammar at its first token."""
        key = (spec.kind, spec.source, spec.after_thought)
        with self._cache_lock:
            refusal = self._refusals.get(key)
        if refusal is None:
            outcome = self._compile(spec)
            if not isinstance(outcome, str):
                return CompiledGrammar(
                    spec, outcome, self.mask_vocab, frozenset(self._eos_ids), self._blanks()
                )
            refusal = outcome
            with self._cache_lock:
                self._refusals[key] = refusal
                while len(self._refusals) > REFUSALS_KEPT:
                    self._refusals.popitem(last=False)
        raise RequestError(f"'{spec.param}' {refusal}", param=spec.param)

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher | str:
        """The grammar's matcher, or why it is refused."""
        try:
            grammar = spec.llguidance_grammar()
        except (ValueError, TypeError) as error:
            return f"is not valid: {error}"
        if (rules := len(_DEFINITION.findall(grammar))) > MAX_RULES:
            return f"is too large to compile: {rules} rules and terminals, at most {MAX_RULES}"
        if (refs := grammar.count(_REFERENCE)) > MAX_REFS:
            return f"is too large to compile: {refs} $refs, at most {MAX_REFS}"
        limits = llguidance.LLParserLimits(
            initial_lexer_fuel=_LEXER_FUEL, max_grammar_size=_MAX_GRAMMAR_SIZE
        )
        tokenizer = self._tokenizer  # built here, on the caller's thread
        matcher = _on_a_deep_stack(
            lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        )
        if matcher.is_error() or (matcher := self._first_step(matcher)).is_error():
            return f"cannot be compiled: {_reason(matcher)}"
        return matcher

    def _blanks(self) -> tuple[int, ...]:
        """The tokens that are blanks alone (spaces, tabs, newlines): those a grammar of
        blanks allows first. Found once, on the first compile."""
        with self._lock:
            blank_ids = self._blank_ids
        if blank_ids is None:
            matcher = llguidance.LLMatcher(
                self._tokenizer, llguidance.LLMatcher.grammar_from_regex(r"[ \t\r\n]+")
            )
            bitmask = allocate_token_bitmask(1, self.mask_vocab)
            fill_next_token_bitmask(matcher, bitmask, 0)
            allowed = unpack_mask(bitmask, self.mask_vocab)[0]
            blank_ids = tuple(int(t) for t in np.flatnonzero(allowed) if t not in self._eos_ids)
            with self._lock:
                self._blank_ids = blank_ids
        return blank_ids

    def _first_step(self, matcher: llguidance.LLMatcher) -> llguidance.LLMatcher:
        """`matcher`, or a copy that failed its first mask or token. llguidance builds
        its lexer and parser rows lazily, so a grammar past their limits (a{100000}{100000},
        20,000 alternatives on one prefix) compiles, then fails at the first token: a
        row's failure mid-reply, where a 400 at admission is what the client needs."""
        probe = matcher.deep_copy()
        bitmask = allocate_token_bitmask(1, self.mask_vocab)
        fill_next_token_bitmask(probe, bitmask, 0)
        allowed = [t for t in np.flatnonzero(unpack_mask(bitmask, self.vocab_size)[0])]
        first = next((int(t) for t in allowed if t not in self._eos_ids), None)
        if probe.is_error() or (first is not None and not probe.consume_token(first)):
            return probe
        return matcher


_STACK_SIZE_LOCK = threading.Lock()


def _on_a_deep_stack(build: Callable[[], llguidance.LLMatcher]) -> llguidance.LLMatcher:
    """`build()` run on a thread of COMPILE_STACK_BYTES, the caller waiting for it."""
    built: list[llguidance.LLMatcher] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            built.append(build())
        except BaseException as error:  # re-raised on the caller's thread
            failed.append(error)

    # The size is the process's setting for new threads: set for this one alone.
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if failed:
        raise failed[0]
    return built[0]


def _reason(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, without the parser state it appends (which quotes the whole
    grammar: 250 KB for a large one), on one line."""
    return " ".join(matcher.get_error().split("<state>")[0].split())[:300]


def bar_eos(allowed: np.ndarray, eos_ids: list[int]) -> None:
    """Clear `eos_ids` in one row's mask unless nothing else is allowed (a grammar that
    can take nothing more is done before it samples: the row never draws from nothing)."""
    kept = allowed[eos_ids].copy()
    allowed[eos_ids] = False
    if not allowed.any():
        allowed[eos_ids] = kept


def unpack_mask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, W] int32 bit words (token t is bit t % 32 of word t // 32) -> [B, V] bool.

    Reads the words as little-endian bytes, as x86-64 and arm64 store them."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # [B, 32 W]
    return bits[:, :vocab_size].view(np.bool_)
