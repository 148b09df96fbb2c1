"""Chat messages as the template sees them: the one rule HTTP and the embedding API share."""

from runtime.errors import RequestError

import pytest

from actors.chat_messages import chat_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        # An image part carrying a caption is still an image: its text is not the content.
        (
            {"role": "user", "content": [{"type": "image_url", "text": "a cat", "image_url": {}}]},
            "messages[0].content",
        ),
        # A refusal is the assistant's to have said; a part's type must be a known string.
        (
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
            "messages[0].content",
        ),
        (
            {"role": "assistant", "content": [{"type": ["text"], "text": "x"}]},
            "messages[0].content",
        ),
        (
            {"role": "assistant", "content": [{"type": "refusal", "text": "no"}]},
            "messages[0].content",
        ),
        # Only an assistant turn makes calls: a user's would reach the template as one.
        ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "messages[0].tool_calls"),
        ({"role": "tool", "tool_call_id": 7, "content": "4"}, "messages[0].tool_call_id"),
        ({"role": "tool", "name": ["add"], "content": "4"}, "messages[0].name"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 1}]},
            "messages[0].tool_calls[0].id",
        ),
        ("hi", "messages[0]"),
        # Arguments are JSON text on the wire, as OpenAI's: an object is no call's arguments.
        (
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": {}}}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_a_bad_message_is_refused_naming_its_key(message, param):
    with pytest.raises(RequestError) as raised:
        chat_messages([message])
    assert raised.value.param == param


def test_no_messages_is_refused():
    # Refused here, by name: not left to what a template makes of no turns.
    with pytest.raises(RequestError) as raised:
        chat_messages([])
    assert raised.value.param == "messages"


def test_content_of_no_parts_is_empty_text():
    assert chat_messages([{"role": "user", "content": []}]) == ({"role": "user", "content": ""},)


def test_messages_that_are_no_list_are_refused_as_a_whole():
    with pytest.raises(RequestError) as raised:
        chat_messages("hello")  # not a list of its characters
    assert raised.value.param == "messages"


def test_an_unknown_role_is_echoed_cut_short():
    with pytest.raises(RequestError) as raised:
        chat_messages([{"role": "x" * 10_000, "content": "hi"}])
    assert raised.value.param == "messages[0].role" and len(str(raised.value)) < 200


def test_a_message_is_rebuilt_from_the_keys_cadence_knows():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "4"},
    ]  # fmt: skip
    assert chat_messages(messages) == (
        {"role": "developer", "content": "be brief"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"},
    )


def test_an_assistant_turn_replayed_with_a_refusal_part_says_it():
    """OpenAI's assistant content may hold refusal parts beside text ones (a 400 here)."""
    parts = [
        {"type": "text", "text": "I can't "},
        {"type": "refusal", "refusal": "help with that."},
    ]
    [message] = chat_messages([{"role": "assistant", "content": parts}])
    assert message == {"role": "assistant", "content": "I can't help with that."}


def test_an_assistant_turns_reasoning_reaches_the_template_under_the_names_templates_read():
    (turn,) = chat_messages([{"role": "assistant", "content": "Paris.", "reasoning": "Capital of France."}])
    (both,) = chat_messages([{"role": "assistant", "content": "", "reasoning": "A.", "reasoning_content": "B."}])
    assert both["reasoning_content"] == "A."  # `reasoning` first, as replied
    assert (turn["reasoning_content"], turn["thinking"]) == ("Capital of France.",) * 2
    (turn,) = chat_messages([{"role": "assistant", "content": "", "reasoning": "", "reasoning_content": "Hm."}])
    assert turn["thinking"] == "Hm."  # an empty one gives way to the other name's
    (turn,) = chat_messages([{"role": "assistant", "content": "x", "reasoning": None, "reasoning_content": ""}])
    assert "thinking" not in turn and "reasoning_content" not in turn
    for bad in ({"role": "user", "content": "x", "reasoning": "no"}, {"role": "assistant", "reasoning_content": 5}):
        with pytest.raises(RequestError, match="must be a string on an assistant message"):
            chat_messages([bad])
