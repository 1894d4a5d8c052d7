"""Structured output and tools through the whole cluster (router + a prefill pod + a decode pod, separate processes,
the OpenAI HTTP front) with the official `openai` client, on a tiny random checkpoint with SmolLM2's tokenizer and a
Hermes-style chat template that renders tools (SmolLM2's own template ignores them):

- response_format json_schema: the output parses and validates against the schema for 20 seeded prompts (the first
  token is sampled under the grammar on the prefill pod, the rest on the decode pod); json_object parses; vLLM's
  guided_regex / guided_choice / guided_grammar hold;
- an invalid schema, regex or grammar is a 400 naming the problem;
- tools: tool_choice required and a named function come back as tool_calls whose arguments are JSON valid against
  the function's schema (streamed and not); a follow-up turn with the tool's result renders through the template.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
from e2e_helpers import e2e_cluster

from pdserve.client import Client
from pdserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["sun", "rain", "snow"]},
    },
    "required": ["city", "temp", "sky"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You can call functions:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls is defined %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tiny(tiny_factory, tmp_path_factory):
    src = tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)
    dst = tmp_path_factory.mktemp("tools-model") / "tiny"
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny):
    c = e2e_cluster(
        tmp_path_factory.mktemp("structured"),
        tiny,
        num_prefill=1,
        num_decode=1,
        decode_tp=1,
        decode_dcp=1,
        num_kv_blocks=256,
        http=True,
    )
    endpoints = c.start()
    try:
        yield endpoints
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", max_retries=0, timeout=300) as client:
        yield client


def chat(oai, content: str, **kw):
    return oai.chat.completions.create(model="", messages=[{"role": "user", "content": content}], **kw)


def test_json_schema_output_validates_for_20_seeded_prompts(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        r = chat(
            oai,
            f"Weather report number {seed}, as JSON.",
            response_format=fmt,
            seed=seed,
            temperature=1.0,
            max_tokens=120,
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_parses_and_streams_the_same(oai):
    kw = dict(
        response_format={"type": "json_object"},
        seed=3,
        temperature=0.7,
        max_tokens=150,
        extra_body={"guided_decoding_backend": "xgrammar"},
    )
    r = chat(oai, "Give me an object.", **kw)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in chat(oai, "Give me an object.", stream=True, **kw) if c.choices
    )
    assert streamed == text


def test_guided_regex_choice_and_grammar_hold(oai):
    for seed in range(3):
        r = chat(
            oai, "An id?", extra_body={"guided_regex": r"[A-F]{3}-\d{2,4}"}, seed=seed, temperature=1.0, max_tokens=20
        )
        assert re.fullmatch(r"[A-F]{3}-\d{2,4}", r.choices[0].message.content)
        choices = ["positive", "negative", 'it\'s "mixed"']
        r = chat(oai, "Sentiment?", extra_body={"guided_choice": choices}, seed=seed, temperature=1.0, max_tokens=20)
        assert r.choices[0].message.content in choices
    r = oai.completions.create(
        model="",
        prompt="Sum:",
        max_tokens=30,
        seed=1,
        temperature=1.0,
        extra_body={"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'},
    )
    assert re.fullmatch(r"\(\d(\+\d)?\)", r.choices[0].text)


def test_every_one_of_n_sequences_follows_the_constraint(oai):
    """n > 1 forks one prefilled prompt into sequences that each keep their own matcher (seeded apart): every choice
    holds the regex, streamed or not, and so does each of the n tool-call argument objects of a named function."""
    pattern = r"[A-F]{3}-\d{2,4}"
    r = chat(oai, "Ids?", n=4, extra_body={"guided_regex": pattern}, seed=5, temperature=1.0, max_tokens=20)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(re.fullmatch(pattern, c.message.content) for c in r.choices), [c.message.content for c in r.choices]
    texts: dict[int, str] = {}
    for chunk in chat(
        oai, "Ids?", n=3, stream=True, extra_body={"guided_regex": pattern}, seed=6, temperature=1.0, max_tokens=20
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and all(re.fullmatch(pattern, t) for t in texts.values()), texts
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(oai, "Weather?", n=2, tools=[WEATHER], tool_choice=named, seed=7, temperature=1.0, max_tokens=120)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "Unsupported type",
        ),
        ({"guided_regex": "a(b"}, "parenthesis"),
        ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "only one kind"),
        ({"tool_choice": "required"}, "needs tools"),
    ],
)
def test_invalid_constraints_are_400_naming_the_problem(oai, extra, needle):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(oai, "hi", max_tokens=5, extra_body=extra)
    assert needle in ei.value.message


def check_call(call, tools=(WEATHER, TIME)) -> dict:
    assert call.type == "function" and call.id
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


def test_tool_choice_named_and_required_give_valid_tool_calls_then_the_result_renders(oai, cluster, tiny):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = chat(
            oai,
            "Weather in Paris?",
            tools=[WEATHER, TIME],
            tool_choice=named,
            seed=seed,
            temperature=1.0,
            max_tokens=80,
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and msg.content is None
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        check_call(msg.tool_calls[0])
        r = chat(
            oai,
            "Weather or time?",
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            temperature=1.0,
            max_tokens=80,
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        (call,) = r.choices[0].message.tool_calls
        check_call(call)

    # Streamed: the same call, in OpenAI's delta shape.
    kw = dict(tools=[WEATHER, TIME], tool_choice=named, seed=5, temperature=1.0, max_tokens=80)
    whole = chat(oai, "Weather in Oslo?", **kw).choices[0].message.tool_calls[0]
    deltas = [c.choices[0] for c in chat(oai, "Weather in Oslo?", stream=True, **kw) if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == whole.function.arguments and deltas[-1].finish_reason == "stop"

    # Follow-up turn: the assistant's call and the tool's answer go back through the template.
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": whole.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": whole.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": whole.id, "content": '{"temp": 4, "sky": "rain"}'},
    ]
    r = oai.chat.completions.create(model="", messages=turn, tools=[WEATHER], max_tokens=4, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    with Client(cluster.router) as client:
        c = client.chat(turn, tools=[WEATHER], max_tokens=1, return_prompt_token_ids=True)
    rendered = Tokenizer(tiny).decode(c.prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in rendered and '<tool_response>{"temp": 4' in rendered
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]["unit"]) in rendered
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": ' in rendered  # the call, as an object


def test_tool_choice_none_renders_no_tools_and_auto_renders_them(oai):
    def prompt_tokens(**kw) -> int:
        return chat(oai, "hi", max_tokens=1, **kw).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == plain
    assert prompt_tokens(tools=[WEATHER], tool_choice="auto") > plain + 20


def test_auto_parses_a_hermes_call_the_model_writes(oai):
    # The random model will not write a call by itself: a guided_choice makes it write exactly one.
    call = 'On it. <tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    kw = dict(tools=[WEATHER, TIME], max_tokens=60, extra_body={"guided_choice": [call]})
    r = chat(oai, "Time?", **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "On it."
    assert [(c.function.name, check_call(c)) for c in msg.tool_calls] == [("get_time", {"zone": "cet"})]
    chunks = [c.choices[0] for c in chat(oai, "Time?", stream=True, **kw) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "On it. "  # text before the call, streamed
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_time", {"zone": "cet"})]
    assert chunks[-1].finish_reason == "tool_calls"
