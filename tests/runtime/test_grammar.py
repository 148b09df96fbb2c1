"""Structured output in the batch: a grammar-constrained row beside free rows.

The constrained row's text parses and validates against its schema, the free rows'
greedy tokens are exactly those of a batch without it, the row ends when its grammar
is complete, max_tokens cuts it short as LENGTH, and a bad grammar is refused by name.
"""

import itertools
import json
import re
import shutil
import threading
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.grammar import (
    BLANKS_AFTER_THOUGHT,
    MAX_REFS,
    MAX_RULES,
    REFUSALS_KEPT,
    GrammarCompiler,
    GrammarSpec,
    ThoughtFirst,
    _after_text_thought,
    _on_a_deep_stack,
    answer_json_schema,
    shapes_content_only,
)
from runtime.grammar_masks import token_masks
from runtime.kv.base import RowSpan
from runtime.kv.blocks import BlockPool
from runtime.runner import run_offline
from runtime.scheduler import FcfsScheduler
from runtime.sequence import FinishCause, SamplingParams, SequenceParams, StepBatch
from runtime.tokenizer import Tokenizer
from runtime.tool_grammars import tool_call_grammar

import attrs
import jsonschema
import mlx.core as mx
import numpy as np
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DEMO_DIR = Path(__file__).resolve().parents[2] / "runtime" / "demo"
FREE = {"a": (11, 305, 42, 977), "b": (7, 8, 9), "c": (900, 5, 6, 70, 71)}


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return load_model(make_checkpoint("llama"))


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_batch=8)


@pytest.fixture(scope="module")
def compiler(model, engine):
    return GrammarCompiler(model.tokenizer, model.config.vocab_size, engine.eos_ids)


def run(engine, requests, lookahead=1):
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    got = run_offline(engine, policy, requests, lookahead=lookahead)
    assert pool.num_used_blocks == 0 and engine.num_open == 0
    return got


def free_rows(max_tokens=24):
    return {
        rid: SequenceParams(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=rid)
        for rid, prompt in FREE.items()
    }


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_schema_row_validates_and_leaves_its_neighbours_greedy_tokens_alone(
    engine, compiler, model, lookahead
):
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format"))
    alone = run(engine, free_rows(), lookahead)
    constrained = {
        f"json{i}": SequenceParams(
            (11, 305 + i, 42),
            max_tokens=80,
            request_id=f"json{i}",
            grammar=grammar,
            sampling=SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i),
        )
        for i in range(2)
    }
    got = run(engine, {**free_rows(), **constrained}, lookahead)
    for rid in FREE:
        assert got[rid].tokens == alone[rid].tokens, rid
    for rid in constrained:
        text = model.tokenizer.decode(got[rid].tokens)
        jsonschema.validate(json.loads(text), SCHEMA)
        # It ended because the grammar was complete, not at max_tokens.
        assert got[rid].finish is FinishCause.EOS and len(got[rid].tokens) < 80, text


def test_max_tokens_cuts_a_json_short_as_length(engine, compiler, model):
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format"))
    got = run(
        engine, {"j": SequenceParams((11, 305), max_tokens=3, request_id="j", grammar=grammar)}
    )
    assert got["j"].finish is FinishCause.LENGTH and len(got["j"].tokens) == 3
    text = model.tokenizer.decode(got["j"].tokens)
    assert text.startswith("{") and text.endswith("}") is False


def test_a_grammar_completed_by_the_last_allowed_token_finishes_as_eos_not_length(
    engine, compiler, model
):
    """A choice completed by its max_tokens-th token is whole: reported as LENGTH
    (`finish_reason: length`), a client would take it for an answer cut short."""
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(["a"]), "guided_choice"))
    got = run(
        engine, {"c": SequenceParams((11, 305), max_tokens=1, request_id="c", grammar=grammar)}
    )
    assert model.tokenizer.decode(got["c"].tokens) == "a"
    assert got["c"].finish is FinishCause.EOS


def test_ignore_eos_keeps_a_grammar_that_can_go_on_from_ending_at_an_eos(
    engine, compiler, model
):
    """An EOS the grammar allows once it is complete was sampled and ended the row
    (`a+` stopped after one `a`, `x?` answered nothing) though the request said
    ignore_eos: now the row goes on while its grammar can, and ends when it cannot."""
    eos = min(engine.eos_ids)
    requests = {
        rid: SequenceParams(
            (11, 305),
            max_tokens=5,
            request_id=rid,
            ignore_eos=True,
            grammar=compiler.compile(GrammarSpec("regex", regex, "guided_regex")),
            sampling=SamplingParams(logit_bias={eos: 100.0}),
        )
        for rid, regex in (("more", "a+"), ("optional", "x?"))
    }
    got = run(engine, requests)
    assert not engine.eos_ids & set(got["more"].tokens + got["optional"].tokens)
    assert got["more"].finish is FinishCause.LENGTH and len(got["more"].tokens) == 5
    assert set(model.tokenizer.decode(got["more"].tokens)) == {"a"}
    assert model.tokenizer.decode(got["optional"].tokens) == "x"
    assert got["optional"].finish is FinishCause.EOS  # complete: the grammar can take no more


def test_a_tokenizer_holding_ids_past_the_models_rows_still_takes_grammars(
    make_checkpoint, tmp_path
):
    """Gemma 3 1B's tokenizer holds <image_soft_token> at id 262,144 of a 262,144-row
    model: llguidance was given the model's size and refused every grammar ("vocab size
    too small; 2048 vs 2049" here). The masks now cover the tokenizer, cut to the model."""
    path = tmp_path / "wider-tokenizer"
    shutil.copytree(make_checkpoint("llama"), path)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    extra = {**tokenizer["added_tokens"][0], "id": vocab_size, "content": "<image_soft_token>"}
    tokenizer["added_tokens"].append(extra)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    wider = load_model(path)
    assert wider.tokenizer.highest_token_id == vocab_size
    engine = Engine(wider, max_batch=2)
    compiler = GrammarCompiler(wider.tokenizer, vocab_size, engine.eos_ids)
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(["yes", "no"]), "guided_choice"))
    got = run(engine, {"c": SequenceParams((11, 305), max_tokens=8, request_id="c", grammar=grammar)})
    assert wider.tokenizer.decode(got["c"].tokens, skip_special_tokens=True) in ("yes", "no")
    assert got["c"].finish is FinishCause.EOS


@pytest.mark.parametrize(
    ("kind", "source", "check"),
    [
        ("regex", r"[0-9]{3}-[a-z]{2}", re.compile(r"[0-9]{3}-[a-z]{2}").fullmatch),
        ("choice", json.dumps(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (
            "lark",
            'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/',
            re.compile(r"\([1-9](\+[1-9])*\)").fullmatch,
        ),
        # A bias towards "}" (id 95) would write "}}}..." free; the grammar makes it "{}".
        ("json_object", "", lambda t: json.loads(t) == {}),
    ],
)
def test_each_grammar_kind_constrains_sampled_text(engine, compiler, model, kind, source, check):
    grammar = compiler.compile(GrammarSpec(kind, source, "guided"))
    requests = {
        f"r{i}": SequenceParams(
            (11, 305 + i),
            max_tokens=60,
            request_id=f"r{i}",
            grammar=grammar,
            sampling=SamplingParams(temperature=1.0, seed=i, logit_bias={95: 30.0}),
        )
        for i in range(3)
    }
    for rid, result in run(engine, requests).items():
        text = model.tokenizer.decode(result.tokens)
        assert result.finish is FinishCause.EOS and check(text), (rid, text)
        assert not engine.eos_ids & set(result.tokens)  # it ends on completion, not on an EOS


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (
            GrammarSpec(
                "json_schema", '{"type": "nonsense"}', "response_format.json_schema.schema"
            ),
            "response_format.json_schema.schema",
        ),
        (GrammarSpec("json_schema", "{not json", "guided_json"), "guided_json"),
        (GrammarSpec("regex", "([a-z]", "guided_regex"), "guided_regex"),
        (GrammarSpec("lark", "start: missing_rule", "guided_grammar"), "guided_grammar"),
        (GrammarSpec("xml", "<a/>", "grammar"), "grammar"),  # an embedder's unknown kind
    ],
)
def test_a_bad_grammar_is_refused_naming_its_field(compiler, spec, named):
    with pytest.raises(RequestError) as raised:
        compiler.compile(spec)
    assert raised.value.param == named and named in str(raised.value)


def test_the_boolean_schemas_admit_any_json_and_nothing(compiler, model):
    """`true` is the schema `{}`, as JSON Schema defines it; `false` a 400 that says why."""
    grammar = compiler.compile(GrammarSpec("json_schema", "true", "guided_json"))
    for text in ('[1, "a"]', "5", '{"k": null}'):
        state = grammar.start()
        assert all(state.advance(t) is None for t in model.tokenizer.encode(text, add_special_tokens=False)), text
    with pytest.raises(RequestError) as raised:
        compiler.compile(GrammarSpec("json_schema", "false", "guided_json"))
    assert raised.value.param == "guided_json" and "admits no value" in str(raised.value)
    with pytest.raises(RequestError):  # an embedder's source that is no text at all
        compiler.compile(GrammarSpec("json_schema", 5, "grammar"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [f"value{i}" for i in range(50_000)]},  # the lexer's initial size
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20_000)}},
        {
            "anyOf": [
                {"properties": {f"k{i}": {"pattern": f"[a-z]{{{i + 1}}}"}}} for i in range(3000)
            ]
        },
    ],
)
def test_a_pathological_schema_is_refused_within_limits(compiler, schema):
    """Refused by a size limit, at once (0.3-2.7 s on a loaded box). Without cadence's
    limits the enum compiled and the anyOf ran 18 s into another of llguidance's limits."""
    with pytest.raises(RequestError) as raised:
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema), "response_format"))
    assert raised.value.param == "response_format"
    assert re.search(r"too (big|large)", str(raised.value)), raised.value


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("regex", "a{100000}{100000}", "guided_regex"),
        GrammarSpec("lark", "start: " + " | ".join(f'"t{i}"' for i in range(20_000)), "guided_grammar"),
        GrammarSpec("json_schema", '{"$ref": "#"}', "guided_json"),  # a schema with no end
        # Complete when empty: the probe must take a real token, not an EOS, to find out.
        GrammarSpec("lark", 'start: "" | ' + " | ".join(f'"t{i}"' for i in range(20_000)), "guided_grammar"),
    ],
)
def test_a_grammar_past_the_limits_at_its_first_token_is_refused_at_compile(compiler, spec):
    """llguidance builds its lexer and parser rows lazily: these compiled, then failed
    the reply at its first token (a 500 quoting the whole grammar, 250 KB for the lark)."""
    with pytest.raises(RequestError) as raised:
        compiler.compile(spec)
    assert raised.value.param == spec.param and len(str(raised.value)) < 400
    assert "<state>" not in str(raised.value)


def rule_chain(n):
    """A Lark grammar whose rules chain: r0 names r1, which names r2, ... rn."""
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(n)) + f'\nr{n}: "z"'


def ref_chain(n):
    """A schema whose $defs chain by $ref, each link an object holding an array of the next."""

    def link(i):
        following = {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"type": "null"}]}
        return {"type": "object", "properties": {"a": {"type": "array", "items": following}}}

    defs = {f"l{i}": link(i) for i in range(n)}
    return json.dumps({"$defs": {**defs, f"l{n}": {"type": "string"}}, "$ref": "#/$defs/l0"})


@pytest.mark.parametrize(
    ("spec", "limit"),
    [
        (GrammarSpec("lark", rule_chain(MAX_RULES), "guided_grammar"), f"at most {MAX_RULES}"),  # 250 kB
        (GrammarSpec("json_schema", ref_chain(3000), "response_format"), f"at most {MAX_REFS}"),  # 300 kB
        (GrammarSpec("lark", f"start: %json {ref_chain(3000)}", "guided_grammar"), f"at most {MAX_REFS}"),
        # One past the README's limits: 10,001 definitions (start, r0..r9999), 2,001 $refs.
        (GrammarSpec("lark", rule_chain(9_999), "guided_grammar"), "10001 rules and terminals, at most 10000"),
        (GrammarSpec("json_schema", ref_chain(2_000), "response_format"), "2001 $refs, at most 2000"),
    ],
)
def test_a_grammar_of_too_many_rules_or_refs_is_refused_before_it_is_compiled(compiler, spec, limit):
    """llguidance recursed along such chains before its limits, overflowing the stack
    (3,000 links did): a segmentation fault ended the whole server."""
    with pytest.raises(RequestError) as raised:
        compiler.compile(spec)
    assert raised.value.param == spec.param and limit in str(raised.value)


@pytest.mark.parametrize(
    # At the README's limits: 10,000 definitions (start, r0..r9998), 2,000 $refs.
    "spec", [GrammarSpec("lark", rule_chain(9_998), "g"), GrammarSpec("json_schema", ref_chain(1_999), "g")]
)
def test_a_chain_within_the_limits_compiles_from_a_thread_of_a_small_stack(compiler, model, spec):
    """The compile runs on a thread of its own, of COMPILE_STACK_BYTES: a chain of 3,000
    rules overflowed an 8 MB stack, and one of these objects at 500 links."""
    outcome = []
    threading.stack_size(8 << 20)
    try:
        thread = threading.Thread(target=lambda: outcome.append(compiler.compile(spec)))
        thread.start()
    finally:
        threading.stack_size(0)
    thread.join()
    state = outcome[0].start()
    first = model.tokenizer.encode("b" if spec.kind == "lark" else "{", add_special_tokens=False)[0]
    assert state.advance(first) is None


def test_a_deep_stack_compile_gives_back_its_result_or_its_error_and_the_stack_size():
    """`_on_a_deep_stack` runs on a daemon thread of its own (a compile still running
    never holds up the process's exit), re-raises the build's own error on the caller's
    thread, and leaves the size of threads started later as it was."""
    threading.stack_size(0)  # the platform's default, whatever an earlier test left
    ran_on = _on_a_deep_stack(threading.current_thread)
    assert ran_on is not threading.current_thread() and ran_on.daemon

    def failing():
        raise ValueError("the build's own error")

    with pytest.raises(ValueError, match="^the build's own error$"):
        _on_a_deep_stack(failing)
    assert threading.stack_size() == 0


def test_a_refused_token_says_why_in_one_short_line(compiler, model):
    """A row's grammar error names the cause without the parser state llguidance
    appends (multi-line, and for a large grammar it quotes the grammar: 250 KB)."""
    state = compiler.compile(GrammarSpec("choice", json.dumps(["yes"]), "guided_choice")).start()
    n = model.tokenizer.encode("no", add_special_tokens=False)[0]
    refused = state.advance(n)
    assert refused is not None and "doesn't satisfy the grammar" in refused
    assert "<state>" not in refused and "\n" not in refused and len(refused) < 400


def test_masks_allow_everything_on_free_rows(compiler):
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(["yes"]), "guided_choice"))
    masks = token_masks([None, grammar.start(), None], compiler.vocab_size)
    assert masks.shape == (3, compiler.vocab_size)
    assert masks[0].all().item() and masks[2].all().item()
    assert 0 < masks[1].sum().item() < compiler.vocab_size
    assert token_masks([None, None], compiler.vocab_size) is None


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_constrained_row_is_never_planned_ahead_of_its_token(engine, compiler, model, lookahead):
    """The scheduler skips lookahead for it; the engine fails a constrained row fed a
    queued sample, so an EOS finish with all its tokens shows it never was."""
    grammar = compiler.compile(GrammarSpec("regex", "[a-z]{30}", "guided_regex"))
    requests = {
        **free_rows(40),
        "g": SequenceParams((11, 305), max_tokens=30, request_id="g", grammar=grammar),
    }
    plans = []
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    got = run_offline(engine, policy, requests, lookahead=lookahead, on_step=plans.append)
    text = model.tokenizer.decode(got["g"].tokens)
    assert got["g"].finish is FinishCause.EOS and re.fullmatch("[a-z]{30}", text)
    sampled_in = [
        i for i, p in enumerate(plans) if any(s.request_id == "g" and s.samples for s in p.spans)
    ]
    # While the free rows decode every step, it takes one in lookahead + 1.
    assert len(sampled_in) == len(got["g"].tokens)
    assert sampled_in[2] - sampled_in[1] == lookahead + 1


def test_the_engine_fails_a_constrained_row_fed_its_queued_sample(compiler, model):
    """Its mask needs the token collected first; a plan that feeds it one is refused."""
    engine = Engine(model, max_batch=1)
    grammar = compiler.compile(GrammarSpec("regex", "[a-z]{30}", "guided_regex"))
    seq = engine.open(SequenceParams((11, 305), max_tokens=30, grammar=grammar))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, 2, (0,)),)))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 2, 1, (0,)),)))  # its queued sample
    outcomes = engine.collect() + engine.collect()
    assert [o.finish for o in outcomes] == [FinishCause.ERROR] and "constrained" in outcomes[0].error


def test_every_choice_is_allowed_at_the_start(compiler, model):
    choices = ["yes", "no", "maybe"]
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(choices), "guided_choice"))
    allowed = token_masks([grammar.start()], compiler.vocab_size)[0]
    for choice in choices:
        first = model.tokenizer.encode(choice, add_special_tokens=False)[0]
        assert allowed[first].item(), choice


def test_thousands_of_choices_compile_and_each_is_a_choice_whole(compiler, model):
    """Past 2,000 choices llguidance's parser refused them as alternatives of a rule; one
    terminal holds any number. A choice that is a prefix of another ends only there."""
    choices = [f"item{i}" for i in range(3000)] + ["a", "ab"]
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(choices), "guided_choice"))
    for text, done in (("item2999", True), ("item29", False), ("a", False), ("ab", True)):
        state = grammar.start()
        for token in model.tokenizer.encode(text, add_special_tokens=False):
            assert state.advance(token) is None, text
        assert state.is_done == done, text
    state = grammar.start()
    refused = [state.advance(token) for token in model.tokenizer.encode("item3000", add_special_tokens=False)]
    assert any(reason is not None for reason in refused)


def test_a_row_is_done_only_when_its_grammar_can_take_nothing_more(compiler, model):
    """Complete but extensible (one digit of [0-9]+) is not done; a finished choice is."""

    def fed(kind, source, text):
        state = compiler.compile(GrammarSpec(kind, source, "guided")).start()
        for token in model.tokenizer.encode(text, add_special_tokens=False):
            assert state.advance(token) is None
        return state

    assert not fed("regex", "[0-9]+", "5").is_done
    assert fed("choice", json.dumps(["yes"]), "yes").is_done


def test_a_long_grammar_error_is_cut_to_one_short_line(compiler):
    with pytest.raises(RequestError) as raised:
        compiler.compile(GrammarSpec("lark", "start: " + "x" * 2000, "guided_grammar"))
    assert "unknown name" in str(raised.value) and len(str(raised.value)) < 400


def test_choices_match_as_text_and_a_choice_that_is_no_list_is_refused(compiler, model):
    grammar = compiler.compile(GrammarSpec("choice", json.dumps([1, 22]), "guided_choice"))
    state = grammar.start()
    for token in model.tokenizer.encode("22", add_special_tokens=False):
        assert state.advance(token) is None
    assert state.is_done
    with pytest.raises(RequestError) as raised:
        compiler.compile(GrammarSpec("choice", "5", "guided_choice"))
    assert raised.value.param == "guided_choice"


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_generated_json_has_no_free_whitespace(compiler, model, kind):
    grammar = compiler.compile(GrammarSpec(kind, json.dumps(SCHEMA), "response_format"))
    state = grammar.start()
    (brace,) = model.tokenizer.encode("{", add_special_tokens=False)
    assert state.advance(brace) is None
    allowed = token_masks([state], compiler.vocab_size)[0]
    for blank in (" ", "\n", "  "):
        (token,) = model.tokenizer.encode(blank, add_special_tokens=False)
        assert not allowed[token].item(), repr(blank)
    assert allowed.any().item()


def test_a_grammar_failing_past_its_first_token_fails_the_row_naming_its_field(
    engine, compiler, model
):
    """`(a{100000}{100000})?` passes the compile probe (its first token may be EOS or
    anything cheap), then blows past llguidance's lexer limits at the second "a". The
    row fails alone, and its outcome names the request field whose value is at fault,
    so the client hears a 400 about its grammar, not a 500 about the server."""
    grammar = compiler.compile(GrammarSpec("regex", "(a{100000}{100000})?", "guided_regex"))
    (a,) = model.tokenizer.encode("a", add_special_tokens=False)
    forced = SamplingParams(temperature=0.0, logit_bias=((a, 100.0),))  # greedy: "a" each time
    requests = {
        **free_rows(12),
        "g": SequenceParams(
            (11, 305), max_tokens=8, request_id="g", grammar=grammar, sampling=forced
        ),
    }
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    outcomes = []
    original_collect = engine.collect

    def collect():
        step = original_collect()
        outcomes.extend(step)
        return step

    engine.collect = collect
    try:
        got = run_offline(engine, policy, requests)
    finally:
        del engine.collect
    assert got["g"].finish is FinishCause.ERROR and got["g"].tokens == (a,)
    assert "too many expressions" in got["g"].error
    (failed,) = [o for o in outcomes if o.error is not None]
    assert failed.error_param == "guided_regex"
    assert all(got[name].finish is FinishCause.LENGTH for name in free_rows(12))


def test_a_call_or_the_answer_each_kind_of_json_answer(compiler, model):
    """`auto` tools beside a response_format: one call, or the answer in its format."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'

    def accepts(spec, text):
        state = compiler.compile(spec).start()
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        return all(state.advance(t) is None for t in ids)

    for answer, good, bad in [
        (GrammarSpec("json_object", "", "response_format"), '{"k": 1}', "[1]"),
        (GrammarSpec("json_schema", "true", "response_format"), "[1]", "x"),
        (GrammarSpec("json_schema", '{"type": "integer"}', "response_format"), "7", '"7"'),
    ]:
        either = tool_call_grammar("hermes", tools, None, answer)
        assert either.param == "response_format"
        assert accepts(either, call) and accepts(either, good), answer
        assert not accepts(either, bad), answer
    for schema in ("false", "{", "[]"):
        answer = GrammarSpec("json_schema", schema, "response_format.json_schema.schema")
        with pytest.raises(RequestError) as raised:
            tool_call_grammar("hermes", tools, None, answer)
        assert raised.value.param == answer.param


def test_a_refused_grammar_is_refused_again_without_compiling(compiler, monkeypatch):
    compiled = []
    compile_now = GrammarCompiler._compile

    def counted(self, spec):
        compiled.append(spec)
        return compile_now(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", counted)
    too_big = "b{100000}{100001}"
    for param in ("guided_regex", "grammar"):
        with pytest.raises(RequestError, match=f"'{param}' cannot be compiled") as refused:
            compiler.compile(GrammarSpec("regex", too_big, param))
        assert refused.value.param == param  # errors name the field this request sent
    assert len(compiled) == 1


def test_the_oldest_refusals_are_forgotten_first(compiler, monkeypatch):
    compiled = []
    compile_now = GrammarCompiler._compile

    def counted(self, spec):
        compiled.append(spec.source)
        return compile_now(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", counted)
    fresh = GrammarCompiler(compiler._source, compiler.vocab_size, compiler._eos_ids)
    refused = [GrammarSpec("json_schema", " " * i + "false", "guided_json") for i in range(REFUSALS_KEPT + 1)]
    for spec in [*refused, refused[-1], refused[1], refused[0]]:
        with pytest.raises(RequestError):
            fresh.compile(spec)
    # The last and the second were remembered; the first, the oldest, made room.
    assert compiled == [spec.source for spec in refused] + [refused[0].source]


def test_only_response_format_shapes_the_content_alone():
    """OpenAI's `response_format` (json_object, or json_schema named by its schema) leaves
    tools callable beside it; vLLM's guided fields hold the whole reply."""
    for param in ("response_format", "response_format.json_schema.schema"):
        assert shapes_content_only(GrammarSpec("json_schema", "{}", param)), param
    for param in ("guided_json", "structured_outputs.json", "grammar"):
        assert not shapes_content_only(GrammarSpec("json_schema", "{}", param)), param


@pytest.mark.parametrize("source", ["1", "1.0", "[]", '"x"', "null"])
def test_an_answer_schema_that_is_no_object_is_refused(source):
    with pytest.raises(RequestError) as raised:
        answer_json_schema(GrammarSpec("json_schema", source, "response_format"))
    assert raised.value.param == "response_format"
    assert answer_json_schema(GrammarSpec("json_schema", "true", "response_format")) == {}


def test_a_grammar_that_fails_mid_reply_fails_the_same_way_for_the_next_request():
    """Copies of one matcher share its lexer and its limits: a kept matcher that one
    reply had taken past them failed the next request's grammar before its first token."""
    demo = Tokenizer.from_dir(DEMO_DIR)
    compiler = GrammarCompiler(demo, demo.vocab_size, demo.eos_token_ids)
    (a,) = demo.encode("a", add_special_tokens=False)
    for _ in range(2):
        state = compiler.compile(GrammarSpec("regex", "(a{100000}{100000})?", "guided_regex")).start()
        assert token_masks([state], demo.vocab_size)[0, a].item()  # the first "a" is fine
        assert state.advance(a) is None
        token_masks([state], demo.vocab_size)
        assert "too many expressions" in (state.advance(a) or "")  # the second is past them


# A `<think>` model's reply under a grammar (ThoughtFirst): three ids stand in for
# `<think>`, `</think>` and a word of the thought. Biases 10 apart and a repetition
# penalty that halves a used token's logit write them in order at temperature 0.
OPEN, CLOSE, WORD = 300, 301, 302
YES_NO = GrammarSpec("choice", json.dumps(["yes", "no"]), "guided_choice")


def thinking(rid, bias, is_open, grammar, max_tokens=16, **kw):
    return SequenceParams(
        (11, 305),
        max_tokens=max_tokens,
        request_id=rid,
        grammar=grammar,
        thought_first=ThoughtFirst(OPEN, CLOSE, is_open),
        sampling=SamplingParams(logit_bias=bias, repetition_penalty=2.0),
        **kw,
    )


def answer_after(tokens, thought, grammar, model):
    """The text past `thought` and the blanks after it (at most BLANKS_AFTER_THOUGHT)."""
    assert list(tokens[: len(thought)]) == thought
    rest = list(tokens[len(thought) :])
    blanks = list(itertools.takewhile(grammar.blank_ids.__contains__, rest))
    assert len(blanks) <= BLANKS_AFTER_THOUGHT
    return model.tokenizer.decode(rest[len(blanks) :])


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_grammar_waits_for_the_thought_to_end_and_shapes_what_follows(
    engine, compiler, model, lookahead
):
    """The thought (opened by the prompt, or by the reply's first token) takes tokens
    the grammar refuses, and EOS aside, any; `</think>` hands the reply to the grammar.
    Without ThoughtFirst the same biases cannot place a token outside the grammar."""
    grammar = compiler.compile(YES_NO)
    opened = {WORD: 100, CLOSE: 90}
    opening = {OPEN: 100, WORD: 90, CLOSE: 80}
    requests = {
        "opened": thinking("opened", opened, True, grammar),
        "opening": thinking("opening", opening, False, grammar),
        "plain": attrs.evolve(thinking("plain", opening, False, grammar), thought_first=None),
    }
    got = run(engine, requests, lookahead)
    assert answer_after(got["opened"].tokens, [WORD, CLOSE], grammar, model) in ("yes", "no")
    assert answer_after(got["opening"].tokens, [OPEN, WORD, CLOSE], grammar, model) in ("yes", "no")
    assert model.tokenizer.decode(got["plain"].tokens) in ("yes", "no")
    assert all(result.finish is FinishCause.EOS for result in got.values())


def test_a_first_token_that_opens_no_thought_starts_the_grammar(engine, compiler, model):
    """Where the prompt opened no thought, a first token the grammar allows is the
    answer's: the grammar holds from there (WORD, favoured, never gets in). A grammar
    that writes `<think>` itself takes the tag as its own, and shapes the thought too."""
    writes_the_tag = compiler.compile(GrammarSpec("lark", f'start: <[{OPEN}]> "yes"', "guided_grammar"))
    requests = {
        "answer": thinking("answer", {OPEN: -100, WORD: 100}, False, compiler.compile(YES_NO)),
        "tag": thinking("tag", {OPEN: 100, WORD: 90}, False, writes_the_tag),
    }
    got = run(engine, requests)
    assert model.tokenizer.decode(got["answer"].tokens) in ("yes", "no")
    assert got["tag"].tokens[0] == OPEN
    assert model.tokenizer.decode(got["tag"].tokens[1:]) == "yes"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_thought_cannot_end_the_reply_on_an_eos(engine, compiler, ignore_eos):
    eos = min(engine.eos_ids)
    request = thinking("t", {eos: 100}, True, compiler.compile(YES_NO), max_tokens=4, ignore_eos=ignore_eos)
    got = run(engine, {"t": request})["t"]
    assert got.finish is FinishCause.LENGTH and len(got.tokens) == 4
    assert not engine.eos_ids & set(got.tokens)


def test_a_few_blank_tokens_may_follow_the_thought_before_the_grammar(engine, compiler, model):
    """JSON's grammar takes no leading blanks, yet Qwen3 writes "\\n\\n" past `</think>`:
    blank tokens are allowed there, BLANKS_AFTER_THOUGHT at most."""
    grammar = compiler.compile(YES_NO)
    assert model.tokenizer.decode(grammar.blank_ids[:1]).isspace()
    blank = model.tokenizer.encode("\n\n")[-1]
    assert blank in grammar.blank_ids
    got = run(engine, {"b": thinking("b", {WORD: 100, CLOSE: 90, blank: 80}, True, grammar)})["b"]
    cut = 2 + BLANKS_AFTER_THOUGHT
    assert list(got.tokens[:cut]) == [WORD, CLOSE] + [blank] * BLANKS_AFTER_THOUGHT
    assert model.tokenizer.decode(got.tokens[cut:]) in ("yes", "no")


@pytest.mark.parametrize("is_open", [True, False])
def test_a_blank_the_grammar_takes_after_the_thought_is_the_grammars(engine, compiler, model, is_open):
    """A grammar whose answer begins with a blank takes it, past `</think>` or as the
    reply's first token: it is no free blank, which the grammar would still want after."""
    blank = model.tokenizer.encode("\n\n")[-1]
    grammar = compiler.compile(GrammarSpec("regex", re.escape(model.tokenizer.decode([blank])) + "(yes|no)", "guided_regex"))
    assert blank in grammar.blank_ids
    bias = {WORD: 100, CLOSE: 90, blank: 80} if is_open else {OPEN: -100, WORD: -100, blank: 80}
    got = run(engine, {"b": thinking("b", bias, is_open, grammar)})["b"]
    thought = [WORD, CLOSE] if is_open else []
    assert list(got.tokens[: len(thought) + 1]) == [*thought, blank]
    assert model.tokenizer.decode(got.tokens[len(thought) + 1 :]) in ("yes", "no")
    assert got.finish is FinishCause.EOS


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_preempted_row_resumes_its_thought_and_its_grammar(model, lookahead):
    """Preemption recomputes the K/V alone: the row's place in its thought or grammar
    stays, so each reply is the one it writes alone."""
    engine = Engine(model, max_batch=4, block_size=4)
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size, engine.eos_ids)
    long_answer = compiler.compile(GrammarSpec("regex", "(yes|no)( (yes|no)){40}", "guided_regex"))
    requests = {
        "thought": thinking("thought", {CLOSE: -100}, True, long_answer, max_tokens=30),
        "answer": thinking("answer", {CLOSE: 100}, True, long_answer, max_tokens=30),
        "opening": thinking("opening", {OPEN: 100, CLOSE: 90}, False, long_answer, max_tokens=30),
    }
    alone = {rid: run(engine, {rid: request}, lookahead)[rid].tokens for rid, request in requests.items()}
    pool = BlockPool(12, engine.kv.block_size)  # 48 tokens for three rows of 32
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context, 8, 12, 0)
    got = run_offline(engine, policy, requests, lookahead=lookahead)
    assert policy.num_preemptions > 0
    assert {rid: result.tokens for rid, result in got.items()} == alone
    assert CLOSE not in alone["thought"] and alone["answer"][0] == CLOSE
    assert alone["opening"][:2] == (OPEN, CLOSE)


def test_a_thinking_row_fed_its_queued_sample_takes_the_mask_its_token_picks(compiler):
    """Inside the thought the next mask is the thought's (all but EOS), or where the
    queued token is `</think>`, the one past it: the grammar's first tokens and blanks."""
    grammar = compiler.compile(YES_NO)
    vocab = compiler.vocab_size
    state = grammar.start(thought=ThoughtFirst(OPEN, CLOSE, True))
    thought = token_masks([state], vocab)[0]
    past = token_masks([state.past_thought()], vocab)[0]
    assert thought[WORD].item() and not past[WORD].item() and past[grammar.blank_ids[0]].item()
    for fed, expected in [(WORD, thought), (CLOSE, past)]:
        masks = token_masks([None, state], vocab, [mx.array([7]), mx.array([fed])])
        assert masks[0].all().item() and mx.array_equal(masks[1], expected).item(), fed
    assert state.is_thinking  # masks read the state, never advance it
    state.advance(CLOSE)
    with pytest.raises(ValueError, match="inside its thought"):
        token_masks([state], vocab, [mx.array([WORD])])


@pytest.mark.parametrize("phase", ["may_think", "thought", "blanks"])
def test_a_thinking_rows_mask_leaves_out_ids_past_the_models_vocabulary(compiler, phase):
    """A tokenizer may hold ids the model has no logits for (its EOS, a tag, a blank):
    the mask, cut to the model's V, widens by those under V alone."""
    vocab = 300  # the model's V here: OPEN and up are past it
    grammar = attrs.evolve(compiler.compile(YES_NO), eos_ids=frozenset({vocab}), blank_ids=(vocab,))
    state = grammar.start(thought=ThoughtFirst(OPEN, CLOSE, is_open=phase != "may_think"))
    if phase == "blanks":
        state.advance(CLOSE)
    assert state.phase == phase
    allowed = np.zeros(vocab, dtype=bool)
    state.fill_mask(allowed)
    assert allowed.all() if phase == "thought" else not allowed.any()


def test_the_engine_fails_a_thinking_row_fed_two_queued_samples(compiler, model):
    """The mask past the second depends on the first: only one may be in flight."""
    engine = Engine(model, max_batch=1)
    params = thinking("t", {}, True, compiler.compile(YES_NO))
    seq = engine.open(params)
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, 2, (0,)),)))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 2, 1, (0,)),)))  # its one queued sample
    outcomes = engine.collect() + engine.collect()
    assert [(o.finish, o.is_thinking) for o in outcomes] == [(None, True), (None, True)]
    for start in (3, 4, 5):  # the last with a second in flight
        engine.submit(StepBatch((RowSpan(seq.seq_id, start, 1, (0,)),)))
    outcomes = engine.collect() + engine.collect() + engine.collect()
    assert [o.finish for o in outcomes] == [FinishCause.ERROR] and "constrained" in outcomes[0].error


def test_the_engine_fails_a_thinking_row_fed_anything_but_its_queued_sample(compiler, model):
    """With a sample in flight a thinking row may be fed that sample alone: a span over
    earlier tokens would take the queued one as its input."""
    engine = Engine(model, max_batch=1)
    seq = engine.open(thinking("t", {}, True, compiler.compile(YES_NO)))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 0, 2, (0,)),)))
    engine.submit(StepBatch((RowSpan(seq.seq_id, 1, 1, (0,)),)))  # the prompt's last token, again
    outcomes = engine.collect() + engine.collect()
    assert [o.finish for o in outcomes] == [FinishCause.ERROR] and "only it can be fed" in outcomes[0].error


def thinking_json(rid, bias, is_open, grammar, **kw):
    """A thinking row under a JSON schema, with logprobs: `bias` writes its thought."""
    params = thinking(rid, bias, is_open, grammar, max_tokens=24, **kw)
    return attrs.evolve(params, sampling=attrs.evolve(params.sampling, logprobs=3))


@pytest.fixture(scope="module")
def json_grammar(compiler):
    return compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format"))


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_thinking_row_writes_the_same_reply_with_or_without_lookahead(
    engine, compiler, json_grammar, model, lookahead
):
    """Fed its queued sample inside the thought, a row draws what it draws with the
    lookahead off, logprobs included, and a token drawn while `</think>` was still
    queued keeps to the mask past the thought; a grammar that writes `<think>` itself
    is no thought and skips the lookahead (the engine would fail it otherwise)."""
    blank, eos = model.tokenizer.encode("\n\n")[-1], min(engine.eos_ids)
    writes_the_tag = compiler.compile(GrammarSpec("lark", f'start: <[{OPEN}]> "yes"', "guided_grammar"))
    seeded = SamplingParams(temperature=1.0, seed=5, repetition_penalty=2.0, logprobs=3)
    # Past `</think>` the penalized WORD and CLOSE still lead: under the thought's mask
    # the row would draw one of them, under the mask past it `{` or a blank.
    requests = {
        **free_rows(24),
        "opened": thinking_json("opened", {WORD: 100, CLOSE: 90}, True, json_grammar),
        "blank": thinking_json("blank", {WORD: 100, CLOSE: 90, blank: 70}, True, json_grammar),
        "opening": thinking_json("opening", {OPEN: 100, WORD: 90, CLOSE: 80}, False, json_grammar),
        "eos": thinking_json("eos", {eos: 100, WORD: 90, CLOSE: 80}, True, json_grammar, ignore_eos=True),
        "seeded": attrs.evolve(
            thinking_json("seeded", {}, True, json_grammar),
            sampling=attrs.evolve(seeded, logit_bias={WORD: 100, CLOSE: 90}),
        ),
        # n choices: each its own row and state
        **{f"choice{i}": thinking_json(f"choice{i}", {WORD: 100, CLOSE: 90}, True, json_grammar) for i in range(2)},
        "tag": thinking("tag", {OPEN: 100, WORD: 90}, False, writes_the_tag),
    }
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    known = {rid: [] for rid in requests}  # per token: how many before it were collected when it was planned

    def on_step(plan):
        for span in plan.spans:
            request = policy.running[span.request_id]
            if span.samples:
                known[span.request_id].append(len(request.tokens) - len(request.params.prompt_tokens))

    got = run_offline(engine, policy, requests, lookahead=lookahead, on_step=on_step)
    off = run(engine, requests, lookahead=0)
    assert {rid: (r.tokens, r.finish, r.logprobs) for rid, r in got.items()} == {
        rid: (r.tokens, r.finish, r.logprobs) for rid, r in off.items()
    }
    for rid in ("opened", "blank", "opening", "eos", "seeded", "choice0"):
        tokens = got[rid].tokens
        thought = [OPEN, WORD, CLOSE] if rid == "opening" else [WORD, CLOSE]
        assert answer_after(tokens, thought, json_grammar, model).startswith('{"name": "'), rid
        close = tokens.index(CLOSE)
        # `</think>` was still in flight when the token after it was planned.
        assert known[rid][close + 1] == close, rid
        assert WORD not in dict(got[rid].logprobs[close + 1].top)  # (-inf: masked)
    assert got["blank"].tokens[2] in json_grammar.blank_ids
    assert got["choice0"].tokens == got["choice1"].tokens
    assert model.tokenizer.decode(got["tag"].tokens[1:]) == "yes" and got["tag"].finish is FinishCause.EOS


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_thinking_row_is_planned_in_consecutive_steps_until_its_thought_ends(
    engine, json_grammar, lookahead
):
    """Inside the thought a constrained row keeps the lookahead (one sample in flight:
    at lookahead 2, two steps in three), past it one step in lookahead + 1."""
    requests = {
        **free_rows(60),  # they outlast it: every plan is a step after the one before
        "thought": thinking("thought", {CLOSE: -100}, True, json_grammar, max_tokens=16),
        "answer": thinking("answer", {CLOSE: 100}, True, json_grammar, max_tokens=16),
    }
    plans = []
    pool = BlockPool(engine.kv.num_blocks, engine.kv.block_size)
    policy = FcfsScheduler(engine.max_batch, pool, engine.max_context)
    got = run_offline(engine, policy, requests, lookahead=lookahead, on_step=plans.append)

    def gaps(rid):
        steps = [i for i, p in enumerate(plans) if any(s.request_id == rid and s.samples for s in p.spans)]
        assert len(steps) == len(got[rid].tokens)
        return [b - a for a, b in itertools.pairwise(steps)]

    assert got["thought"].finish is FinishCause.LENGTH and CLOSE not in got["thought"].tokens
    # Its first token is collected before the engine says it is thinking.
    assert gaps("thought")[1:] == ([1] * 14 if lookahead == 1 else [1, 2] * 7)
    assert got["answer"].tokens[0] == CLOSE and set(gaps("answer")[1:]) == {lookahead + 1}


# OLMo 3 Think's tags are text: `</think>` is several tokens of the vocabulary.
TEXT_TAGS = ("<think>", "</think>")


def after_text_thought(compiler, is_open, spec=YES_NO):
    return compiler.compile(attrs.evolve(spec, after_thought=(*TEXT_TAGS, is_open)))


@pytest.mark.parametrize(
    ("is_open", "text", "verdict"),
    [
        (True, "a </thin> <think> b</think>\n\nyes", "done"),  # the first `</think>` ends it
        (True, "</think>no", "done"),  # an empty thought
        (True, "a yes", "open"),  # still the thought: no answer yet
        (True, "a</think>x", "refused"),  # past the thought, the grammar's
        (True, "a</think>" + " " * 9 + "yes", "refused"),  # more blanks than a model writes there
        (True, "a</think>yes</think>", "refused"),  # one thought
        (False, "yes", "done"),  # the prompt opened none: an answer at once
        (False, "<think>a</think>\nno", "done"),  # or a thought the reply opens
        (False, "a", "refused"),
    ],
)
def test_a_grammar_past_a_text_thought_takes_free_text_up_to_the_closing_tag(
    compiler, model, is_open, text, verdict
):
    state = after_text_thought(compiler, is_open).start()
    refused = [state.advance(token) for token in model.tokenizer.encode(text, add_special_tokens=False)]
    if verdict == "refused":
        assert any(reason is not None for reason in refused)
    else:
        assert refused == [None] * len(refused) and state.is_done is (verdict == "done")


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_grammar_past_a_text_thought_shapes_what_follows_the_closing_tag(engine, compiler, model, lookahead):
    """Biases and a repetition penalty that takes nine tenths of a used token's logit
    write a word and `</think>` token by token (the prompt holds none of them), then the
    grammar holds: the same biases cannot place the word where the grammar applies from
    the first token."""
    closing = model.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(closing) > 1 and WORD not in closing
    bias = {token: 100 - 10 * i for i, token in enumerate([WORD, *closing])}

    def request(rid, grammar):
        sampling = SamplingParams(logit_bias=bias, repetition_penalty=10.0)
        return SequenceParams((11, 305), max_tokens=24, request_id=rid, grammar=grammar, sampling=sampling)

    got = run(engine, {"text": request("text", after_text_thought(compiler, True)), "plain": request("plain", compiler.compile(YES_NO))}, lookahead)
    text = model.tokenizer.decode(got["text"].tokens)
    thought, _, answer = text.partition("</think>")
    assert thought == model.tokenizer.decode([WORD]) and answer.strip() in ("yes", "no")
    assert got["text"].finish is FinishCause.EOS
    assert model.tokenizer.decode(got["plain"].tokens) in ("yes", "no")


def test_a_text_thought_cannot_end_the_reply_on_an_eos(engine, compiler):
    eos = min(engine.eos_ids)
    request = SequenceParams(
        (11, 305), max_tokens=4, request_id="t", grammar=after_text_thought(compiler, True),
        sampling=SamplingParams(logit_bias={eos: 100}),
    )
    got = run(engine, {"t": request})["t"]
    assert got.finish is FinishCause.LENGTH and not engine.eos_ids & set(got.tokens)


def test_a_grammar_past_a_text_thought_that_is_no_one_grammar_is_refused(compiler):
    """A refusal names the request's field, as any grammar's."""
    spec = attrs.evolve(GrammarSpec("lark", "start: @other", "guided_grammar"), after_thought=(*TEXT_TAGS, True))
    with pytest.raises(RequestError, match="guided_grammar"):
        compiler.compile(spec)


def test_a_text_thought_goes_before_exactly_one_grammar():
    two = json.dumps({"grammars": [{"lark_grammar": 'start: "a"'}, {"lark_grammar": 'start: "b"'}]})
    for grammar in (two, "{}", '{"grammars": []}'):
        with pytest.raises(ValueError, match="one grammar"):
            _after_text_thought(grammar, *TEXT_TAGS, True)


def test_an_olmo3_call_or_answer_follows_a_text_thought(compiler, model):
    """A forced call, and `auto` beside a response_format, past a text thought: their
    Lark grammars (JSON embedded) are the answer the thought is followed by."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    answer = GrammarSpec("json_object", "", "response_format")
    call = "<function_calls>f()</function_calls>"
    for spec, good in [
        (tool_call_grammar("olmo3", tools, "f"), [call]),
        (tool_call_grammar("olmo3", tools, None, answer), [call, '{"k": 1}']),
    ]:
        for reply in good:
            state = after_text_thought(compiler, True, spec).start()
            ids = model.tokenizer.encode(f"Hmm, {call}?</think>\n{reply}", add_special_tokens=False)
            assert all(state.advance(t) is None for t in ids) and state.is_done, reply
