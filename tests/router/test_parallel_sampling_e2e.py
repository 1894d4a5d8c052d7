"""n > 1, best_of and echo with prompt logprobs through the whole cluster (router + a prefill pod + a decode pod,
separate processes, the OpenAI HTTP front) with the official `openai` client, on a tiny random checkpoint:

- n = 4 with a seed gives 4 sequences, each equal to a single request seeded by vLLM's child rule (seed + i), while
  the prefill pod computed the prompt once (its Prometheus counter of prompt tokens computed);
- greedy n = 2 gives identical choices, streamed chunks carry their choice index;
- best_of returns the n candidates with the highest cumulative logprob, in that order;
- cancelling an n = 4 stream (the client goes away) gives every KV block back on the decode pod;
- echo with logprobs returns the prompt tokens' logprobs (None first), equal to transformers' fp32 log-softmax;
  token-id prompts (one, or a batch) echo the same logprobs as their text, also with max_tokens 0 (the prompt scored
  only, as eval harnesses ask for log-likelihoods) and 1.
"""

from __future__ import annotations

import re
import time
import urllib.request

import openai
import pytest
import torch
from e2e_helpers import metered_http_cluster

from pdserve.net import free_port

pytestmark = pytest.mark.slow

PROMPT = [17, 923, 3045, 88, 412, 77, 1020, 5111, 64, 233, 9]  # 11 tokens: a partly filled last KV block
BLOCKS = 256


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)


@pytest.fixture(scope="module")
def ports():
    return {"prefill": free_port(), "decode": free_port()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny, ports):
    with metered_http_cluster(tmp_path_factory.mktemp("nseq"), tiny, ports, BLOCKS) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", max_retries=0, timeout=120) as client:
        yield client


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def sample(oai, seed: int | None, n: int = 1, max_tokens: int = 10, **kw):
    return oai.completions.create(
        model="",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        n=n,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        **kw,
    )


def test_n_seeded_equals_single_requests_with_child_seeds_and_prefills_once(oai, ports):
    singles = [ids_of(sample(oai, 500 + i).choices[0].logprobs.tokens) for i in range(4)]
    before = metric(ports["prefill"], "pdserve_prefill_prompt_tokens_computed_total")
    r = sample(oai, 500, n=4)
    time.sleep(0.6)  # the pod's counters follow its engine every 0.25 s
    computed = metric(ports["prefill"], "pdserve_prefill_prompt_tokens_computed_total") - before
    assert computed == len(PROMPT)  # one prefill for all four sequences
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [ids_of(c.logprobs.tokens) for c in r.choices] == singles
    assert len({tuple(s) for s in singles}) == 4
    assert r.usage.completion_tokens == 40


def test_greedy_n_gives_identical_choices_and_streams_indexed_chunks(oai):
    r = oai.completions.create(
        model="", prompt=PROMPT, max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    texts = {0: "", 1: ""}
    ends = {}
    for c in oai.completions.create(
        model="", prompt=PROMPT, max_tokens=8, temperature=0, n=2, stream=True, extra_body={"ignore_eos": True}
    ):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                ends[ch.index] = ch.finish_reason
    assert texts == {0: r.choices[0].text, 1: r.choices[0].text} and ends == {0: "length", 1: "length"}
    chat = oai.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 1


def test_best_of_returns_the_n_highest_cumulative_logprobs(oai):
    cands = sample(oai, 77, n=5)
    cum = [sum(c.logprobs.token_logprobs) for c in cands.choices]
    best = sample(oai, 77, n=2, best_of=5)
    order = sorted(range(5), key=lambda k: -cum[k])[:2]
    assert [ids_of(c.logprobs.tokens) for c in best.choices] == [
        ids_of(cands.choices[k].logprobs.tokens) for k in order
    ]
    assert [c.index for c in best.choices] == [0, 1]
    # without logprobs asked for, the choice is the same and no logprobs come back
    plain = oai.completions.create(
        model="",
        prompt=PROMPT,
        max_tokens=10,
        temperature=1.0,
        seed=77,
        n=2,
        best_of=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in plain.choices] == [c.text for c in best.choices]
    assert all(c.logprobs is None for c in plain.choices)


def test_cancelling_an_n4_stream_frees_every_kv_block(oai, ports):
    def free() -> float:
        return metric(ports["decode"], "pdserve_decode_kv_blocks_free")

    assert free() == BLOCKS
    stream = oai.completions.create(
        model="",
        prompt=PROMPT,
        max_tokens=2000,
        temperature=1.0,
        seed=1,
        n=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for c in stream:
        seen.update(ch.index for ch in c.choices if ch.text)
        if len(seen) == 4:
            break
    assert seen == {0, 1, 2, 3}
    assert free() < BLOCKS
    stream.close()  # the client goes away: the router cancels, the decode pod frees all four sequences
    deadline = time.monotonic() + 20
    while free() != BLOCKS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free() == BLOCKS


def test_echo_logprobs_equal_transformers_log_softmax(oai, tiny):
    import transformers

    prompt = "The quick brown fox jumps over"
    r = oai.completions.create(
        model="",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    ids = tok(prompt)["input_ids"]
    n = len(ids)
    assert ids_of(lp.tokens[:n]) == ids
    assert r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, n):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4
        vals, idx = ref[p - 1].topk(2)
        alts = {int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[p].items()}
        for v, i in zip(vals.tolist(), idx.tolist()):
            assert abs(alts[i] - v) < 1e-4
    # the completion's own tokens follow, as without echo
    plain = oai.completions.create(
        model="",
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.text_offset[n] == len(prompt)


def close(a: list, b: list, tol: float = 1e-6) -> bool:
    """Two logprob lists agree: the same Nones, the numbers within ``tol``."""
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or abs(x - y) < tol) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_token_id_prompts_echo_the_logprobs_of_their_text(oai, tiny, max_tokens):
    import transformers

    texts = ["The quick brown fox jumps over", "Scores of a tiny model", "Hello"]
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    ids = [tok(t)["input_ids"] for t in texts]
    kw = dict(
        model="",
        max_tokens=max_tokens,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    by_ids = oai.completions.create(prompt=ids, **kw)
    by_text = oai.completions.create(prompt=texts, **kw)
    single = oai.completions.create(prompt=ids[0], **kw)
    assert single.choices[0].text == by_ids.choices[0].text
    assert close(single.choices[0].logprobs.token_logprobs, by_ids.choices[0].logprobs.token_logprobs)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    for i, (c, t) in enumerate(zip(by_ids.choices, by_text.choices)):
        n, lp = len(ids[i]), c.logprobs
        assert c.index == i and c.text == t.text and c.text.startswith(texts[i])
        assert ids_of(lp.tokens) == ids_of(t.logprobs.tokens) and ids_of(lp.tokens[:n]) == ids[i]
        assert len(lp.tokens) == n + max_tokens and lp.text_offset == t.logprobs.text_offset
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids[i]])).logits[0].float(), dim=-1)
        assert close(lp.token_logprobs, t.logprobs.token_logprobs)
        for p in range(1, n):
            assert abs(lp.token_logprobs[p] - ref[p - 1, ids[i][p]].item()) < 1e-4
        if max_tokens == 0:
            assert c.text == texts[i] and c.finish_reason == "length"
    assert by_ids.usage.completion_tokens == max_tokens * len(texts)
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    streamed = [ch for chunk in oai.completions.create(prompt=ids, stream=True, **kw) for ch in chunk.choices]
    for i, c in enumerate(by_ids.choices):
        mine = [ch for ch in streamed if ch.index == i]
        assert "".join(ch.text for ch in mine) == c.text
        assert close([x for ch in mine for x in ch.logprobs.token_logprobs], c.logprobs.token_logprobs)
        assert mine[-1].finish_reason == c.finish_reason


def test_n_with_max_tokens_1_ends_on_the_prefill_pod(oai):
    singles = [ids_of(sample(oai, 40 + i, max_tokens=1).choices[0].logprobs.tokens) for i in range(3)]
    r = sample(oai, 40, n=3, max_tokens=1)
    assert [ids_of(c.logprobs.tokens) for c in r.choices] == singles and len({s[0] for s in singles}) > 1
    assert [c.finish_reason for c in r.choices] == ["length"] * 3 and r.usage.completion_tokens == 3


def test_sdk_returns_the_n_choices_and_prompt_logprobs(cluster, oai):
    from pdserve.client import Client

    with Client(cluster.router) as client:
        c = client.generate(
            PROMPT, max_tokens=5, temperature=1.0, seed=9, n=3, ignore_eos=True, logprobs=True, prompt_logprobs=1
        )
    http = sample(oai, 9, n=3, max_tokens=5)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in c.choices] == [ids_of(h.logprobs.tokens) for h in http.choices]
    assert c.token_ids == c.choices[0].token_ids and c.usage.completion_tokens == 15
    pl = c.prompt_logprobs
    assert pl.token_ids == PROMPT and pl.logprobs[0] is None and len(pl.logprobs) == len(PROMPT)
    assert all(len(t) == 1 for t in pl.top_logprobs[1:])
