"""Tool calls back from text: the hermes parser (content before the first call, every <tool_call> block, malformed
calls left as text), the required-choice array, and the OpenAI front's reading of tools / tool_choice into the
template's tools and the constraint."""

from __future__ import annotations

import json

import pytest

from router.openai_http import ApiError, parse_chat
from router.tool_parsers import HermesToolParser, calls_from_required, required_schema, tool_parser

FN = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}
G = {"type": "function", "function": {"name": "g"}}


def test_hermes_parses_every_call_and_keeps_the_text_before():
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    # An unterminated last call (max_tokens) still parses when its JSON is whole.
    assert HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"x": 2}}')[1][0].name == "f"


@pytest.mark.parametrize(
    "text", ["no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']
)
def test_hermes_leaves_text_without_a_wellformed_call_alone(text):
    assert HermesToolParser().parse(text) == (text, [])


def test_required_schema_and_its_calls():
    schema = required_schema([FN, G], parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert "maxItems" not in required_schema([FN], parallel=True)
    calls = calls_from_required('[{"name": "f", "parameters": {"x": 3}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 3})]
    assert calls_from_required('[{"name": "f", "parameters": {"x"') == []


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral2000")


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}


def test_front_reads_tool_choice_into_tools_and_constraint():
    p, _, _ = parse_chat(body(tools=[FN, G]))
    assert p.tool_choice == "auto" and p.tools == [FN, G] and "structured_output" not in p.sampling
    p, _, _ = parse_chat(body(tools=[FN, G], tool_choice="none"))
    assert p.tools is None
    p, _, _ = parse_chat(body(tools=[FN, G], tool_choice={"type": "function", "function": {"name": "f"}}))
    assert p.sampling["structured_output"] == {"json_schema": FN["function"]["parameters"]}
    p, _, _ = parse_chat(body(tools=[FN, G], tool_choice="required"))
    assert p.sampling["structured_output"]["json_schema"]["type"] == "array"
    p, _, _ = parse_chat(body(guided_choice=["a", "b"]))
    assert p.sampling["structured_output"] == {"choice": ["a", "b"]}


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tools=[FN], tool_choice={"type": "function", "function": {"name": "h"}}), "not in tools"),
        (dict(tools=[FN], tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
        (dict(tool_choice="sometimes", tools=[FN]), "is not one of"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "parameters"),
        (
            dict(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]),
            "not valid JSON",
        ),
    ],
)
def test_front_refuses_bad_tool_requests(kw, needle):
    with pytest.raises(ApiError, match=needle):
        parse_chat(body(**kw))
