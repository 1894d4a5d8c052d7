"""Against a live local cluster started by `pdserve up` in a subprocess (router, a prefill pod, a decode pod with
TP 2 x DCP 2, the OpenAI HTTP front; tiny random checkpoint with 1 KV head and SmolLM2's tokenizer):

- SDK sync and async streaming: chunks add up to the whole completion, usage and TTFT are reported, streaming and
  whole-text calls agree, sync and async agree;
- chat goes through the model's chat template (the prompt ids are the template's rendering, tokenized);
- cancel (local close and the Cancel RPC) and a deadline both free every KV block the request held;
- server errors surface as the typed exceptions, with the router's message;
- the official `openai` client against the HTTP endpoint, streaming and not, returns the gRPC path's outputs;
- Ctrl-C (SIGINT) to `pdserve up` stops everything: no process it started is left (checked with psutil).

Two slow tests run the default model (SmolLM2): the default topology (its decode layout chosen for this machine's
cores) asks for the capital of France, and a decode pod at TP 9 x DCP 3 (nine shared-memory ranks) gives the same
answer token for token.
"""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
from up_helpers import UpProcess

from pdserve.client import (
    AlreadyExistsError,
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
)

pytestmark = pytest.mark.slow  # a whole local cluster

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny):
    u = UpProcess(
        [
            "--model",
            str(tiny),
            "--port",
            "0",
            "--http-port",
            "0",
            "--decode-tp",
            "2",
            "--decode-dcp",
            "2",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "2048",
        ],
        log_dir=tmp_path_factory.mktemp("up-live"),
        startup_timeout=600,
    )
    try:
        u.start()
    except BaseException:
        u.kill()
        raise
    yield u
    u.__exit__(None, None, None)


@pytest.fixture(scope="module")
def client(up):
    with Client(up.router, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client):
    return client.wait_ready(60)[0]


def _kv(client: Client) -> dict[str, list[tuple[int, int]]]:
    """(free, total) KV blocks per rank of every decode pod (as last reported by its heartbeat)."""
    st = client.cluster_status(role="decode")
    return {p.pod_id: [(r.free_blocks, r.total_blocks) for r in p.kv] for p in st.pods}


def _all_free(kv: dict[str, list[tuple[int, int]]]) -> bool:
    return all(free == total for ranks in kv.values() for free, total in ranks) and bool(kv)


def _wait_idle(client: Client, timeout: float = 20.0) -> dict[str, list[tuple[int, int]]]:
    """Wait until every decode rank reports all its blocks free, no KV lease is held and nothing is in flight."""
    end = time.monotonic() + timeout
    while True:
        kv = _kv(client)
        st = client.cluster_status()
        if (
            _all_free(kv) and sum(p.load.num_active_leases for p in st.pods) == 0 and st.num_inflight_requests == 0
        ) or time.monotonic() > end:
            return kv
        time.sleep(0.2)


def _wait_held(client: Client, timeout: float = 10.0) -> dict[str, list[tuple[int, int]]]:
    end = time.monotonic() + timeout
    while True:
        kv = _kv(client)
        if not _all_free(kv) or time.monotonic() > end:
            return kv
        time.sleep(0.1)


def test_endpoints_and_status(up, client, model_name):
    st = client.cluster_status()
    shapes = {
        p.pod_id: (p.parallel.tensor_parallel_size or 1, p.parallel.decode_context_parallel_size or 1) for p in st.pods
    }
    assert shapes == {"prefill-0": (1, 1), "decode-0": (2, 2)}
    assert model_name in st.ready_models
    assert up.info["http"].startswith("http://127.0.0.1:")
    out = (up.log_dir / "pdserve-up.out").read_text()
    assert up.router in out and "decode-0" in out and "tp=2 dcp=2" in out


def test_sync_streaming(client):
    stream = client.generate_stream(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(stream)
    c = stream.completion
    assert chunks[-1].finished and not any(ch.finished for ch in chunks[:-1])
    assert "".join(ch.text for ch in chunks) == c.text
    assert sum(len(ch.token_ids) for ch in chunks) == len(c.token_ids) == 12
    assert c.finish_reason == "length"
    assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens > 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + 12
    assert 0 < c.timing.ttft_s <= c.timing.e2e_s
    assert c.timing.client_ttft_s is not None and c.timing.client_ttft_s > 0
    assert c.routing.prefill_pod_id == "prefill-0" and c.routing.decode_pod_id == "decode-0"
    whole = client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert whole.text == c.text and whole.token_ids == c.token_ids


def test_async_streaming_matches_sync(up, client):
    ref = client.generate(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)

    async def run():
        async with AsyncClient(up.router, timeout=120) as ac:
            stream = ac.generate_stream(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
            texts = [ch.text async for ch in stream]
            many = await asyncio.gather(
                *(ac.generate(PROMPT, max_tokens=10, temperature=0, ignore_eos=True) for _ in range(4))
            )
            return "".join(texts), stream.completion, many

    text, comp, many = asyncio.run(run())
    assert text == comp.text == ref.text and comp.token_ids == ref.token_ids
    assert comp.usage.completion_tokens == 10 and comp.timing.ttft_s > 0
    assert all(m.token_ids == ref.token_ids for m in many)


def test_chat_uses_the_models_chat_template(client, tiny):
    from pdserve.tokenizer import Tokenizer

    c = client.chat(MSGS, max_tokens=8, temperature=0, return_prompt_token_ids=True)
    tok = Tokenizer(tiny)
    assert c.prompt_token_ids == tok.encode(tok.apply_chat_template(MSGS), add_special_tokens=False)
    assert c.usage.prompt_tokens == len(c.prompt_token_ids)
    assert c.finish_reason in ("stop", "length") and 1 <= c.usage.completion_tokens <= 8
    streamed = "".join(ch.text for ch in client.chat_stream(MSGS, max_tokens=8, temperature=0))
    assert streamed == c.text


def test_cancel_frees_the_blocks(client):
    assert _all_free(_wait_idle(client))
    # local cancel (closing the stream) after a few chunks
    stream = client.generate_stream(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True)
    got = 0
    for ch in stream:
        got += len(ch.token_ids)
        if got >= 3:
            break
    held = _wait_held(client)
    assert not _all_free(held), "the running request holds no decode KV?"
    stream.cancel()
    assert stream.completion.finish_reason == "cancelled" and len(stream.completion.token_ids) >= 3
    assert _all_free(_wait_idle(client)), f"blocks not freed after cancel (held: {held})"
    # Cancel RPC by request id, from another thread while the stream is read
    stream = client.generate_stream(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, request_id="live-c1")
    first = next(stream)
    assert first.token_ids
    assert not _all_free(_wait_held(client))
    threading.Timer(0.2, lambda: client.cancel("live-c1")).start()
    rest = list(stream)
    assert stream.completion.finish_reason == "cancelled"
    assert len(stream.completion.token_ids) < 1500 and rest and rest[-1].finish_reason == "cancelled"
    assert client.cancel("live-c1") is False  # no longer in flight
    assert _all_free(_wait_idle(client))


def test_deadline_exceeded_frees_the_blocks(client):
    assert _all_free(_wait_idle(client))
    # The deadline is a quarter of this cluster's measured time for the long request, so it expires mid-decode
    # however fast the machine is.
    t = time.monotonic()
    client.generate(PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
    max_tokens = 2000
    deadline = min(3.0, (time.monotonic() - t) / 200 * max_tokens / 4)
    t = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        client.generate(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=deadline)
    assert time.monotonic() - t < deadline + 7
    assert _all_free(_wait_idle(client))


def test_server_errors_are_typed_with_the_message(client):
    with pytest.raises(NotFoundError) as ei:
        client.generate("hi", model="no-such-model", max_tokens=2)
    assert "no-such-model" in ei.value.message and str(ei.value) == ei.value.message
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        client.generate([5] * 3000, max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        client.generate([10**8], max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="sampling_params"):
        client.generate("hi", max_tokens=2, temperature=-1.0)
    stream = client.generate_stream(PROMPT, max_tokens=1500, ignore_eos=True, request_id="live-dup")
    next(stream)
    try:
        with pytest.raises(AlreadyExistsError, match="live-dup"):
            client.generate("hi", max_tokens=2, request_id="live-dup")
    finally:
        stream.cancel()


def test_openai_client_matches_the_grpc_path(up, client, model_name):
    oa = openai.OpenAI(base_url=up.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert model_name in [m.id for m in oa.models.list()]

    ref = client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    r = oa.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.usage.prompt_tokens, 12)
    parts = list(
        oa.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == ref.text
    assert [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason] == ["length"]
    assert parts[-1].usage.completion_tokens == 12

    cref = client.chat(MSGS, max_tokens=8, temperature=0)
    r = oa.chat.completions.create(model=model_name, messages=MSGS, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == cref.text
    assert r.usage.completion_tokens == cref.usage.completion_tokens
    parts = list(oa.chat.completions.create(model=model_name, messages=MSGS, max_tokens=8, temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == cref.text
    assert parts[-1].choices[0].finish_reason == cref.finish_reason

    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oa.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="sampling_params"):
        oa.chat.completions.create(model=model_name, messages=MSGS, max_tokens=2, temperature=-1)


def test_openai_batch_prompts_and_disconnect(up, client, model_name):
    oa = openai.OpenAI(base_url=up.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [PROMPT, "Hello there, my friend"]
    refs = [client.generate(p, max_tokens=6, temperature=0, ignore_eos=True).text for p in prompts]
    r = oa.completions.create(
        model=model_name, prompt=prompts, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == refs
    assert r.usage.completion_tokens == 12
    texts = ["", ""]
    for part in oa.completions.create(
        model=model_name, prompt=prompts, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        for ch in part.choices:
            texts[ch.index] += ch.text
    assert texts == refs
    # a streaming HTTP client that goes away: the request is cancelled and its KV freed
    assert _all_free(_wait_idle(client))
    stream = oa.chat.completions.create(
        model=model_name, messages=MSGS, max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    n = 0
    for _ in stream:
        n += 1
        if n >= 4:
            break
    assert not _all_free(_wait_held(client))
    stream.close()
    assert _all_free(_wait_idle(client))


def test_cli_generate_and_status(up, model_name):
    import subprocess
    import sys

    ref = Client(up.router).generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).text
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            PROMPT,
            "--router",
            up.router,
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref + "\n" and "TTFT" in out.stderr and "6 completion tokens" in out.stderr
    chat = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "chat",
            MSGS[1]["content"],
            "--system",
            MSGS[0]["content"],
            "--router",
            up.router,
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == Client(up.router).chat(MSGS, max_tokens=8, temperature=0).text + "\n"
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "hi", "--router", up.router, "--model", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr and "'nope'" in bad.stderr
    st = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--router", up.router],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert st.returncode == 0 and "prefill-0" in st.stdout and "decode-0" in st.stdout and model_name in st.stdout


def test_zz_ctrl_c_leaves_no_process(up):
    """Last in the module: SIGINT to `pdserve up` stops the whole cluster."""
    before = up.descendants()
    assert len(before) >= 6  # router, http front, prefill, decode + its 2nd rank, reaper, ...
    assert up.interrupt(timeout=120) == 0, up.tail()
    left = up.wait_all_gone(10)
    assert left == [], left


def _ask_france(up: UpProcess) -> str:
    with Client(up.router, timeout=300) as c:
        r = c.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24, temperature=0)
    assert "Paris" in r.text, r.text
    oa = openai.OpenAI(base_url=up.http + "/v1", api_key="unused", timeout=300)
    name = oa.models.list().data[0].id
    r2 = oa.chat.completions.create(
        model=name,
        max_tokens=24,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert r2.choices[0].message.content == r.text
    return r.text


@pytest.mark.slow
def test_default_model_answers_and_a_dcp_decode_pod_gives_the_same_answer(tmp_path):
    """`pdserve up` with no topology flags: SmolLM2-135M-Instruct, decode laid out as Topology chooses here (TP 1 on
    small machines); then TP 9 x DCP 3 (each rank holds a third of the tokens): the same greedy text."""
    from pdserve.cluster.topology import Topology

    default = Topology().resolve().decode[0]
    layouts = [([], (default.tensor_parallel_size, default.decode_context_parallel_size))]
    layouts.append((["--decode-tp", "9", "--decode-dcp", "3"], (9, 3)))
    assert layouts[0][1] != layouts[1][1]
    texts = []
    for flags, (tp, dcp) in layouts:
        with UpProcess(
            ["--port", "0", "--http-port", "0", *flags], log_dir=tmp_path / f"logs-{tp}x{dcp}", startup_timeout=900
        ) as up:
            got = {p["name"]: p for p in up.info["pods"]}["decode-0"]
            assert (got["tensor_parallel_size"], got["decode_context_parallel_size"]) == (tp, dcp)
            texts.append(_ask_france(up))
        assert up.wait_all_gone(10) == []
    assert texts[0] == texts[1]
