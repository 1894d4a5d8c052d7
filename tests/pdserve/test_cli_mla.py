"""The CLI on an MLA model (tiny DeepSeek-V3 checkpoint, 8 query heads, SmolLM2's tokenizer and vocabulary so text
prompts and the chat template work): `pdserve offline` at TP 4 x DCP 4 and `pdserve up --decode-tp 8 --decode-dcp 8
--ask` answer with transformers' greedy tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
from e2e_helpers import service_env
from hf_helpers import hf_greedy
from transformers import AutoTokenizer
from up_helpers import UpProcess

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def mla_vocab_model(tiny_factory):
    return tiny_factory("deepseek_v3", num_heads=8, vocab_size=49152)


def _hf_answer(model, ids: list[int], max_tokens: int) -> str:
    tok = AutoTokenizer.from_pretrained(str(model))
    return tok.decode(hf_greedy(model, [ids], max_tokens)[0])


def test_offline_tp4_dcp4(mla_vocab_model):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "offline",
            "--model",
            str(mla_vocab_model),
            "--tensor-parallel-size",
            "4",
            "--decode-context-parallel-size",
            "4",
            "--raw",
            "--max-tokens",
            "8",
            PROMPT,
        ],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ids = AutoTokenizer.from_pretrained(str(mla_vocab_model)).encode(PROMPT)
    want = _hf_answer(mla_vocab_model, ids, 8)
    assert want.strip() and out.stdout.strip() == want.strip()


def test_up_decode_tp8_dcp8_asks(tmp_path, mla_vocab_model):
    up = UpProcess(
        [
            "--model",
            str(mla_vocab_model),
            "--port",
            "0",
            "--http-port",
            "0",
            "--num-kv-blocks",
            "64",
            "--decode-tp",
            "8",
            "--decode-dcp",
            "8",
            "--ask",
            PROMPT,
            "--ask-max-tokens",
            "5",
        ],
        log_dir=tmp_path / "logs",
        env=service_env(),
        startup_timeout=600,
    )
    up.start(wait=False)
    try:
        rc = up.proc.wait(900)
        out = up.output.read_text()
        assert rc == 0, up.tail()
        assert "tp=8 dcp=8" in out and "all processes stopped" in out
        tok = AutoTokenizer.from_pretrained(str(mla_vocab_model))
        ids = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
        )
        assert f"[{len(ids)} prompt + 5 completion tokens" in out  # the same chat rendering as transformers'
        answer = out.split(f"> {PROMPT}\n", 1)[1].split("\n[", 1)[0]
        assert answer == _hf_answer(mla_vocab_model, ids, 5)
        assert up.wait_all_gone(10) == []
    finally:
        up.kill()
