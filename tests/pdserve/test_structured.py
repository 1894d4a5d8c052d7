"""Structured output on the sampler: xgrammar's token bitmask keeps every sampled token inside the request's grammar
(JSON schema, any JSON object, regex, choice, EBNF), a matcher rebuilt from the spec and the tokens so far continues
exactly where another sampler left off (the prefill -> decode handoff), and invalid specs are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.sampling import Sampler
from pdserve.sampling_params import SamplingParams
from pdserve.structured import GrammarBackend, StructuredOutputError, StructuredSpec, check_spec
from pdserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def backend(tok):
    return GrammarBackend.for_tokenizer(tok.hf_tokenizer, tok.vocab_size, [tok.eos_token_id])


def run(
    backend, tok, spec: StructuredSpec, seed: int, n: int = 80, handoff_at: int | None = None, temperature: float = 1.0
) -> tuple[list[int], bool]:
    """Sample with random logits until EOS; with handoff_at, a fresh sampler (a decode pod) takes over from there.
    Returns the tokens and whether EOS ended them."""
    g = torch.Generator().manual_seed(seed)
    samplers = [Sampler([tok.eos_token_id], lambda: backend), Sampler([tok.eos_token_id], lambda: backend)]
    p = SamplingParams(temperature=temperature, seed=seed, max_tokens=n, structured=spec)
    out: list[int] = []
    for step in range(n):
        s = samplers[1 if handoff_at is not None and step >= handoff_at else 0]
        logits = torch.randn(1, tok.vocab_size, generator=g) * 3
        t = s.sample(logits, [p], ["r"], [[1, 2]], [out]).token_ids[0]
        if t == tok.eos_token_id:
            return out, True
        out.append(t)
    return out, False


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_rows_sample_only_valid_json(backend, tok, seed):
    jsonschema = pytest.importorskip("jsonschema")
    ids, ended = run(backend, tok, StructuredSpec.json_schema(SCHEMA), seed, handoff_at=1)
    assert ended, tok.decode(ids)
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_regex_choice_grammar_and_json_object_hold(backend, tok):
    text = tok.decode(run(backend, tok, StructuredSpec("regex", r"[a-c]{2,4}-\d{3}"), 3)[0])
    assert re.fullmatch(r"[a-c]{2,4}-\d{3}", text), text
    choices = ("red apple", 'green "pear"', "plum")
    for seed in range(4):
        assert tok.decode(run(backend, tok, StructuredSpec("choice", choices), seed)[0]) in choices
    ebnf = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    text = tok.decode(run(backend, tok, StructuredSpec("grammar", ebnf), 1)[0])
    assert re.fullmatch(r"\(\d(\+\d)*\)", text), text
    ids, ended = run(backend, tok, StructuredSpec("json_object"), 2, n=200, temperature=0.3)
    if ended:
        assert isinstance(json.loads(tok.decode(ids)), dict)
    else:
        assert tok.decode(ids).lstrip().startswith("{")


def test_handoff_replays_the_first_token_into_a_fresh_matcher(backend, tok):
    spec = StructuredSpec.json_schema(SCHEMA)
    # Greedy over the same logits: one sampler all the way equals prefill's first token + a decode sampler after it.
    assert run(backend, tok, spec, 7, handoff_at=None, temperature=0) == run(
        backend, tok, spec, 7, handoff_at=1, temperature=0
    )


def test_unconstrained_rows_in_the_batch_are_untouched(backend, tok):
    s = Sampler([tok.eos_token_id], lambda: backend)
    logits = torch.randn(2, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    plain = SamplingParams(temperature=0)
    out = s.sample(
        logits,
        [SamplingParams(temperature=0, structured=StructuredSpec("choice", ("yes",))), plain],
        ["a", "b"],
        [[1], [1]],
        [[], []],
    )
    assert out.token_ids[1] == int(logits[1].argmax())
    assert tok.decode([out.token_ids[0]]) in ("y", "yes", "ye")
    assert out.logprobs[1] == pytest.approx(float(torch.log_softmax(logits[1], -1).max()), abs=1e-5)


def test_min_tokens_never_leaves_a_row_without_a_token(backend, tok):
    s = Sampler([tok.eos_token_id], lambda: backend)
    p = SamplingParams(temperature=0, min_tokens=5, max_tokens=8, structured=StructuredSpec("choice", ("a",)))
    out: list[int] = []
    for _ in range(3):
        t = s.sample(torch.zeros(1, tok.vocab_size), [p], ["r"], [[1]], [out]).token_ids[0]
        out.append(t)
    assert tok.decode(out[:1]) == "a" and out[1] == tok.eos_token_id  # the grammar's end beats min_tokens


@pytest.mark.parametrize(
    "spec, needle",
    [
        (StructuredSpec("json_schema", '{"type": "objec"}'), "Unsupported type"),
        (StructuredSpec("regex", "a(b"), "parenthesis"),
        (StructuredSpec("grammar", "root ::= foo"), "foo"),
    ],
)
def test_invalid_specs_are_refused_by_name(backend, spec, needle):
    for check in (check_spec, backend.compile):
        with pytest.raises(StructuredOutputError, match=needle):
            check(spec)


@pytest.mark.parametrize(
    "kind, value, needle",
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1]", "JSON object"),
        ("choice", (), "non-empty"),
        ("regex", "", "non-empty"),
        ("xml", "x", "kind must be one of"),
    ],
)
def test_malformed_specs_fail_at_construction(kind, value, needle):
    with pytest.raises(StructuredOutputError, match=needle):
        StructuredSpec(kind, value)
