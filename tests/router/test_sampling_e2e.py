"""Sampling through the whole cluster (router + a prefill pod + a decode pod, separate processes, the OpenAI HTTP
front) with the official `openai` client, on a tiny random checkpoint with SmolLM2's tokenizer:

- presence, frequency and repetition penalties, greedy: the tokens equal a reference implementation of vLLM's
  definition applied step by step to logits captured from pdserve's engine (run offline on the same checkpoint); the
  first token is sampled on the prefill pod and counted as an output token on the decode pod;
- logprobs (chat and completions shapes) equal transformers' fp32 log-softmax for the chosen and the top tokens;
- min_tokens holds EOS back (even one forced by logit_bias) until reached; logit_bias forces and forbids tokens;
  min_p = 1 samples the most likely token whatever the seed; echo returns the prompt ahead of the completion;
- values past vLLM's limits are HTTP 400 with vLLM's message; what is not served (a response_format of an unknown
  type, the deprecated functions) is refused. Structured output and tools: test_structured_e2e.py; n, best_of and
  echo with logprobs: test_parallel_sampling_e2e.py.
"""

from __future__ import annotations

import openai
import pytest
import torch
from e2e_helpers import e2e_cluster

pytestmark = pytest.mark.slow

PROMPT = [17, 923, 3045, 88, 412, 77, 1020, 5111, 64, 233, 9]
N = 12  # tokens per greedy comparison


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny):
    c = e2e_cluster(
        tmp_path_factory.mktemp("sampling"),
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
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def engine(tiny):
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine

    with LLMEngine(EngineConfig(model=str(tiny), num_kv_blocks=256)) as eng:
        yield eng


def engine_logits(engine, ids: list[int]) -> torch.Tensor:
    """The raw logits pdserve's engine computes for the token after ``ids`` (captured at its sampler)."""
    from pdserve.sampling_params import SamplingParams

    seen: list[torch.Tensor] = []
    real = engine.sampler.sample

    def capture(logits, *a, **k):
        seen.append(logits[0].float().clone())
        return real(logits, *a, **k)

    engine.sampler.sample = capture
    try:
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        engine.sampler.sample = real
    return seen[0]


def vllm_penalized(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
) -> torch.Tensor:
    """vLLM's apply_penalties for one sequence: repetition over prompt + output, the others over the output."""
    logits = logits.clone()
    counts = torch.zeros_like(logits)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    rep = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
    pos = logits > 0
    logits[pos] /= rep[pos]
    logits[~pos] *= rep[~pos]
    return logits - frequency * counts - presence * (counts > 0).float()


def reference(engine, prompt: list[int], n: int = N, bias: dict[int, float] | None = None, **penalties) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        lg = engine_logits(engine, prompt + out)
        for t, b in (bias or {}).items():
            lg[t] += b
        out.append(int(vllm_penalized(lg, prompt, out, **penalties).argmax()))
    return out


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def complete_ids(oai, prompt=PROMPT, n=N, **kw) -> tuple[list[int], object]:
    """Greedy completion of a token prompt; its token ids (from logprobs, named by id)."""
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    r = oai.completions.create(model="", prompt=prompt, max_tokens=n, temperature=0, logprobs=0, extra_body=extra, **kw)
    return ids_of(r.choices[0].logprobs.tokens), r


# A random model hardly repeats a token in a few steps, so penalties would leave its greedy output alone: a bias
# narrows the choice to four tokens (two of them in the prompt), where greedy repeats and every penalty bites.
FEW = {923: 20.0, 3045: 20.0, 4242: 20.0, 13580: 20.0}


@pytest.mark.parametrize(
    "penalties,body",
    [
        (dict(presence=1.5), dict(presence_penalty=1.5)),
        (dict(frequency=1.0), dict(frequency_penalty=1.0)),
        (dict(repetition=1.8), dict(extra_body={"repetition_penalty": 1.8})),
        (
            dict(presence=-0.5, frequency=0.7, repetition=1.3),
            dict(presence_penalty=-0.5, frequency_penalty=0.7, extra_body={"repetition_penalty": 1.3}),
        ),
    ],
    ids=["presence", "frequency", "repetition", "all-three"],
)
def test_penalties_follow_vllms_definition(oai, engine, penalties, body):
    bias = {str(t): b for t, b in FEW.items()}
    plain, _ = complete_ids(oai, logit_bias=bias)
    assert plain == reference(engine, PROMPT, bias=FEW)
    got, r = complete_ids(oai, logit_bias=bias, **body)
    want = reference(engine, PROMPT, bias=FEW, **penalties)
    assert got == want
    assert got != plain  # the penalty changed the output (else this test proves nothing)
    assert r.usage.completion_tokens == N


def test_chat_penalty_and_logprobs_equal_transformers_log_softmax(oai, engine, tiny):
    from transformers import AutoModelForCausalLM

    msgs = [{"role": "user", "content": "Name three colours."}]
    r = oai.chat.completions.create(
        model="",
        messages=msgs,
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        frequency_penalty=0.8,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    ids = ids_of([c.token for c in content])
    assert len(ids) == N and all(len(c.top_logprobs) == 5 for c in content)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), False)
    assert ids == reference(engine, prompt, frequency=0.8)

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    lsm = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # row i predicts output token i
    for i, c in enumerate(content):
        assert abs(c.logprob - float(lsm[i, ids[i]])) < 1e-4, (i, c.logprob, float(lsm[i, ids[i]]))
        top = lsm[i].topk(5)
        assert ids_of([t.token for t in c.top_logprobs]) == top.indices.tolist()
        for t, want in zip(c.top_logprobs, top.values.tolist()):
            assert abs(t.logprob - want) < 1e-4
        assert c.bytes == list(c.token.encode())


def test_completions_logprobs_shape_and_values(oai, engine, tiny):
    from transformers import AutoModelForCausalLM

    r = oai.completions.create(
        model="", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text or r.choices[0].text in "".join(lp.tokens)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    ids, _ = complete_ids(oai, n=6)
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([PROMPT + ids])).logits[0].float(), -1)[len(PROMPT) - 1 : -1]
    for i in range(6):
        assert abs(lp.token_logprobs[i] - float(lsm[i, ids[i]])) < 1e-4
        assert lp.tokens[i] in lp.top_logprobs[i]  # like vLLM: the chosen token is always listed
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(
            lsm[i].topk(3).values.tolist(), abs=1e-4
        )


def test_streamed_logprobs_match_the_whole_answer(oai):
    whole = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    parts = []
    for ch in oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if ch.choices and ch.choices[0].logprobs is not None:
            parts.extend(ch.choices[0].logprobs.content)
    assert [(p.token, round(p.logprob, 5)) for p in parts] == [
        (c.token, round(c.logprob, 5)) for c in whole.choices[0].logprobs.content
    ]


def test_min_tokens_holds_a_forced_eos_back(oai, engine):
    eos = min(engine.eos_ids)
    bias = {str(eos): 100}
    r = oai.completions.create(model="", prompt=PROMPT, max_tokens=20, temperature=0, logit_bias=bias)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1  # EOS right away
    got, r = complete_ids(oai, n=20, logit_bias=bias, extra_body={"min_tokens": 5, "ignore_eos": False})
    assert r.choices[0].finish_reason == "stop"
    assert len(got) == 6 and got[5] == eos and eos not in got[:5]
    assert got[:5] == reference(engine, PROMPT, n=5)  # the masked EOS leaves the greedy choice


def test_logit_bias_forces_and_forbids_tokens(oai, engine):
    got, _ = complete_ids(oai, n=5, logit_bias={"4242": 100})
    assert got == [4242] * 5
    plain = reference(engine, PROMPT, n=3)
    got, _ = complete_ids(oai, n=3, logit_bias={str(plain[0]): -100})
    assert got[0] != plain[0]
    assert got == reference(engine, PROMPT, n=3, bias={plain[0]: -100.0})


def test_min_p_one_is_greedy_whatever_the_seed(oai, engine):
    want = reference(engine, PROMPT, n=6)
    for seed in (1, 2):
        r = oai.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            logprobs=0,
            stream=False,
            extra_body={"min_p": 1.0, "ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        assert ids_of(r.choices[0].logprobs.tokens) == want


def test_echo_returns_the_prompt_first(oai):
    prompt = "The quick brown fox"
    r = oai.completions.create(
        model="", prompt=prompt, max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    plain = oai.completions.create(
        model="", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(
            model="",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


@pytest.mark.parametrize(
    "kind,kw,needle",
    [
        ("completions", dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
        ("completions", dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3.0."),
        ("completions", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty must be greater than zero"),
        ("completions", dict(extra_body={"min_p": 1.5}), "min_p must be in [0, 1], got 1.5."),
        ("completions", dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (
            "completions",
            dict(max_tokens=3, extra_body={"min_tokens": 4}),
            "min_tokens must be less than or equal to max_tokens=3, got 4.",
        ),
        ("completions", dict(logit_bias={"999999": 5}), "logit_bias has token ids out of the model's vocabulary"),
        ("completions", dict(n=0), "'n' must be an integer in [1, 128]"),
        ("completions", dict(n=3, best_of=2), "best_of must be an integer in [n, 128] (n=3)"),
        ("completions", dict(best_of=3, stream=True), "best_of > n cannot be streamed"),
        (
            "chat",
            dict(logprobs=True, top_logprobs=21),
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        ("chat", dict(top_logprobs=3), "when using `top_logprobs`, `logprobs` must be set to true."),
        ("chat", dict(response_format={"type": "yaml"}), "response_format.type must be one of"),
        ("chat", dict(functions=[{"name": "f", "parameters": {}}]), "use tools and tool_choice"),
    ],
)
def test_bad_sampling_is_400_with_a_clear_message(oai, kind, kw, needle):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "completions":
            oai.completions.create(model="", prompt="hello", max_tokens=kw.pop("max_tokens", 4), **kw)
        else:
            oai.chat.completions.create(model="", messages=[{"role": "user", "content": "hello"}], max_tokens=4, **kw)
    assert e.value.status_code == 400 and needle in e.value.message, e.value.message
