"""A tool call's values as JSON: strict JSON (no NaN, Infinity or numbers past a float)
and the Python-call notation some models write calls in (Gemma's ```tool_code, OLMo 3's
and LFM2's lists), read with `ast` and never evaluated."""

from __future__ import annotations

import ast
import json
import math


def strict_json(text: str) -> object:
    """`json.loads` of JSON as RFC 8259 has it: no NaN or Infinity, and no number too
    large for a float (Python reads 1e999 as inf). Call arguments are re-written with
    `json.dumps`, which would send those to the client as JSON that is not JSON."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite_float)

def _not_json(word: str) -> object:
    raise ValueError(f"{word} is not JSON")

def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a float")
    return value

def python_calls(body: str, json_literals: bool = False) -> list[dict[str, object]] | None:
    """`f(a=1)`, `[f(a=1), g(b="x")]` or one call a line -> [{name, arguments}]; None if not that.
    `json_literals`: `true`, `false` and `null` are values too (OLMo 3 writes values as JSON)."""
    text = _hyphens_spelled(body.strip())
    try:
        tree = ast.parse(text if text.startswith("[") else f"[{','.join(text.splitlines())}]")
        (statement,) = tree.body
        # Checks that raise, not asserts: `python -O` strips asserts, and every text
        # that parses as Python would have been taken for calls.
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.List)):
            raise ValueError("no list of calls")
        calls: list[dict[str, object]] = []
        for node in statement.value.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                raise ValueError("no call by keywords")
            # A `**` splat has no name (kw.arg None): dropped, its arguments were lost.
            if any(kw.arg is None for kw in node.keywords):
                raise ValueError("a splat")
            values = (_JsonLiterals().visit(kw.value) if json_literals else kw.value for kw in node.keywords)
            arguments = {kw.arg: ast.literal_eval(value) for kw, value in zip(node.keywords, values, strict=True)}
            json.dumps(arguments, allow_nan=False)  # a set, bytes, `...` or inf is no JSON
            calls.append({"name": node.func.id.replace(_HYPHEN, "-"), "arguments": arguments})
    # MemoryError too: CPython's parser raises it for an expression nested past its
    # stack (`f(a=----...1)` with 10,000 signs), not RecursionError.
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return calls or None

# OpenAI's tool names may hold "-", which no Python name does: between calls, a "-" in
# a name is read as this letter (which no tool name holds: they are ASCII), then back.
_HYPHEN = "\u1428"

def _hyphens_spelled(text: str) -> str:
    """`text` with the hyphens of its calls' names spelled `_HYPHEN`; the calls'
    arguments and any string left as they are."""
    outside = 1 if text.startswith("[") else 0  # the depth between calls
    pieces, depth, at = [], 0, 0
    while at < len(text):
        character = text[at]
        if character in "\"'":  # a string, to its closing quote
            end = at + 1
            while end < len(text) and text[end] != character:
                end += 2 if text[end] == "\\" else 1
            pieces.append(text[at : end + 1])
            at = end + 1
            continue
        depth += (character in "([{") - (character in ")]}")
        between_calls = depth == outside and 0 < at < len(text) - 1
        if character == "-" and between_calls and _in_name(text[at - 1]) and _in_name(text[at + 1]):
            character = _HYPHEN
        pieces.append(character)
        at += 1
    return "".join(pieces)

def _in_name(character: str) -> bool:
    return character.isalnum() or character == "_"

_JSON_LITERALS = {"true": True, "false": False, "null": None}

class _JsonLiterals(ast.NodeTransformer):
    """JSON's literal names, as constants: to literal_eval, any other name is no value."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id not in _JSON_LITERALS:
            return node
        return ast.copy_location(ast.Constant(_JSON_LITERALS[node.id]), node)
