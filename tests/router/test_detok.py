"""Router-side detokenizing and stop strings, against the real default tokenizer."""

from __future__ import annotations

import random

import pytest

from pdserve.tokenizer import Tokenizer
from router.detok import Detokenizer, OutputAssembler


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer(smollm2_path)


def test_incremental_deltas_concatenate_to_the_full_decode(tok):
    rng = random.Random(0)
    texts = [
        "Hello world, this is a test.",
        "naïve café — 東京 🚀 emoji",
        "  leading spaces\n\nnew lines\t tab",
        "<|im_start|>user special<|im_end|>",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        d = Detokenizer(tok)
        out = "".join(d.add(t) for t in ids) + d.flush()
        assert out == tok.decode(ids), text
    # Random ids (bytes that split multi-byte characters, special tokens in the middle).
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d = Detokenizer(tok)
        out = "".join(d.add(t) for t in ids) + d.flush()
        assert out == tok.decode(ids)


def test_incomplete_utf8_is_held_back_not_rewritten(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces
    d = Detokenizer(tok)
    deltas = [d.add(t) for t in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == "🚀"


def test_skip_special_tokens_false_keeps_them(tok):
    ids = tok.encode("<|im_start|>hi", add_special_tokens=False)
    d = Detokenizer(tok, skip_special_tokens=False)
    assert "".join(d.add(t) for t in ids) + d.flush() == tok.decode(ids, skip_special_tokens=False)


def assemble(tok, ids, chunk=1, **kw):
    a = OutputAssembler(tok, **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        final = i + chunk >= len(ids)
        pieces.append(a.add(part, final=final))
        if a.finished:
            break
    return a, pieces


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_truncates_text_and_tokens(tok, chunk):
    ids = tok.encode("The cat sat on the mat. Then it slept.", add_special_tokens=False)
    a, pieces = assemble(tok, ids, chunk, stop=["mat."])
    text = "".join(p.text for p in pieces)
    assert text == "The cat sat on the "
    assert pieces[-1].stop == "mat."
    sent = [t for p in pieces for t in p.token_ids]
    # Tokens up to the one that completed the stop string, none after.
    assert tok.decode(sent).endswith("mat.") or "mat." in tok.decode(sent)
    assert len(sent) < len(ids)
    assert "mat." not in tok.decode(sent[:-1])


def test_stop_string_text_is_never_taken_back(tok):
    ids = tok.encode("abc abd abe", add_special_tokens=False)
    a, pieces = assemble(tok, ids, 1, stop=["abe"])
    streamed = ""
    for p in pieces:
        streamed += p.text
        assert "abe" not in streamed
    assert streamed == "abc abd "


def test_min_tokens_delays_stops(tok):
    ids = tok.encode("stop here stop there", add_special_tokens=False)
    _, pieces = assemble(tok, ids, 1, stop=["stop"], min_tokens=3)
    text = "".join(p.text for p in pieces)
    assert text.startswith("stop here ")
    assert pieces[-1].stop == "stop"


def test_stop_token_id_kept_in_ids_not_in_text(tok):
    ids = tok.encode("hello world again", add_special_tokens=False)
    stop_id = ids[1]
    _, pieces = assemble(tok, ids, 1, stop_token_ids=[stop_id])
    sent = [t for p in pieces for t in p.token_ids]
    assert sent == ids[:2]
    assert pieces[-1].stopped_on_token
    assert "".join(p.text for p in pieces) == tok.decode(ids[:1])


def test_eos_ends_unless_ignore_eos(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    _, pieces = assemble(tok, ids + [5], 1, eos_token_ids=[tok.eos_token_id])
    assert [t for p in pieces for t in p.token_ids] == ids
    assert pieces[-1].stopped_on_token
    _, pieces = assemble(tok, ids + [5], 1, eos_token_ids=[tok.eos_token_id], ignore_eos=True)
    assert [t for p in pieces for t in p.token_ids] == ids + [5]


def test_no_stop_means_nothing_held_back(tok):
    ids = tok.encode("plain streaming text", add_special_tokens=False)
    a = OutputAssembler(tok)
    texts = [a.add([t]).text for t in ids]
    assert "".join(texts) == tok.decode(ids)
