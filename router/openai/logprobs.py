"""OpenAI's logprobs and usage objects, built from the router's chunks and completions (pdserve.client.types)."""

from __future__ import annotations

from typing import Any

from pdserve.client.types import PromptLogprobs

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason for the router's (a cancelled request is vLLM's "abort")."""
    return FINISH.get(reason or "", reason)


def _tok(tid: int, text: str, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else text


def _at(xs: Any, i: int, default: Any) -> Any:
    return xs[i] if xs is not None and i < len(xs) else default


def completion_logprobs(c: Any, as_ids: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs object of a GenerateChunk or a Completion; like vLLM, each top_logprobs entry
    also holds the chosen token. ``offset``: the text offset of its first token."""
    ids, lps = list(c.token_ids), list(c.logprobs or [])
    toks = [_tok(t, _at(c.tokens, i, ""), as_ids) for i, t in enumerate(ids)]
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for i, tok in enumerate(toks):
        names = _at(c.top_tokens, i, {})
        d = {_tok(a, names.get(a, ""), as_ids): lp for a, lp in _at(c.top_logprobs, i, {}).items()}
        d.setdefault(tok, lps[i])
        tops.append(d)
        offsets.append(offset)
        offset += len(_at(c.tokens, i, ""))
    return {"tokens": toks, "token_logprobs": lps[: len(toks)], "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(pl: PromptLogprobs, as_ids: bool) -> dict[str, list[Any]]:
    """The prompt's part of an echoed completions logprobs object: its tokens, their logprobs (None for the first,
    as OpenAI), alternatives (each also holding the prompt token itself, like vLLM) and text offsets from 0."""
    toks = [_tok(t, _at(pl.tokens, i, ""), as_ids) for i, t in enumerate(pl.token_ids)]
    tops: list[dict[str, float] | None] = []
    offsets, at = [], 0
    for i, tok in enumerate(toks):
        alts, names = pl.top_logprobs[i], pl.top_tokens[i] or {}
        d = None if alts is None else {_tok(a, names.get(a, ""), as_ids): lp for a, lp in alts.items()}
        if d is not None:
            d.setdefault(tok, pl.logprobs[i])  # type: ignore[arg-type]
        tops.append(d)
        offsets.append(at)
        at += len(_at(pl.tokens, i, ""))
    return {"tokens": toks, "token_logprobs": list(pl.logprobs), "top_logprobs": tops, "text_offset": offsets}


def echo_text(pl: PromptLogprobs) -> str:
    """A token-id prompt's text, echoed: its tokens' texts as the router detokenized them."""
    return "".join(pl.tokens)


def chat_logprobs(c: Any, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(tid: int, text: str, lp: float) -> dict[str, Any]:
        tok = _tok(tid, text, as_ids)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    content = []
    for i, t in enumerate(c.token_ids):
        e = entry(t, _at(c.tokens, i, ""), c.logprobs[i])
        names = _at(c.top_tokens, i, {})
        e["top_logprobs"] = [entry(a, names.get(a, ""), lp) for a, lp in _at(c.top_logprobs, i, {}).items()]
        content.append(e)
    return {"content": content}


def usage(u: Any) -> dict[str, Any]:
    """OpenAI's usage object of the router's Usage."""
    d: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if getattr(u, "cached_prompt_tokens", 0):
        d["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return d


def add_usage(total: dict[str, int], u: dict[str, Any]) -> None:
    """Sum one request's token counts into ``total`` (a batch of prompts is one response)."""
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[k] += u[k]


def zero_usage() -> dict[str, int]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
