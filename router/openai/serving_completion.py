"""POST /v1/completions: a prompt or a batch of prompts (text or token ids), each its own request to the router,
answered whole or streamed; echo puts each prompt (and, with logprobs, its tokens' logprobs) ahead of its choices.

Choice k of prompt i is index i * n + k (OpenAI's and vLLM's numbering). Echo with max_tokens 0 scores the prompt
only, as vLLM allows: the router is asked for one token (its smallest request, prefill only) which is left out."""

from __future__ import annotations

import time
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from pdserve.client import AsyncClient
from pdserve.client.types import GenerateChunk, PromptLogprobs
from router.openai.logprobs import (
    add_usage,
    completion_logprobs,
    echo_logprobs,
    echo_text,
    finish_reason,
    usage,
    zero_usage,
)
from router.openai.protocol import CompletionRequest, Parsed
from router.openai.streaming import gather, stream_sse

_LP_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class CompletionRun:
    """One completions request's answer, built from its streams' chunks or completions."""

    def __init__(self, p: Parsed, prompts: list[str | list[int]], cid: str, model: str) -> None:
        self.p, self.prompts, self.cid, self.model, self.n = p, prompts, cid, model, p.n
        # prompt i -> its echoed text: a text prompt's own; a token-id prompt's once the router detokenized it
        self.texts = {i: pr for i, pr in enumerate(prompts) if isinstance(pr, str)}
        self.echo = dict(self.texts) if p.echo else {}
        self.echo_due = set(range(len(prompts) * p.n)) if p.echo else set()  # choices whose echo is still to send
        self.prompt_lps: dict[int, PromptLogprobs] = {}
        self.offsets = [0] * (len(prompts) * p.n)  # text_offset of each choice's next token

    def sampling(self, i: int) -> dict[str, Any]:
        """The router's sampling fields for prompt i: a token-id prompt to echo needs the router to detokenize
        it, which it does with the prompt's logprobs (this front has no tokenizer)."""
        if self.p.echo and i not in self.texts and "prompt_logprobs" not in self.p.sampling:
            return {**self.p.sampling, "prompt_logprobs": 0}
        return self.p.sampling

    def take(self, i: int, pl: PromptLogprobs | None) -> None:
        if pl is not None:
            self.prompt_lps[i] = pl
            if self.p.echo:
                self.echo.setdefault(i, echo_text(pl))

    def _echoes(self, j: int) -> bool:
        return j in self.echo_due and j // self.n in self.echo

    def choice(self, j: int, c: Any, finished: bool) -> dict[str, Any]:
        """Choice j of a chunk or completion ``c``: its echo first, once."""
        echoed = self._echoes(j)
        self.echo_due.discard(j)
        text = (self.echo[j // self.n] if echoed else "") + ("" if self.p.prompt_only else c.text)
        lp = self._logprobs(j, c, echoed) if self.p.top_logprobs is not None else None
        finish = ("length" if self.p.prompt_only else finish_reason(c.finish_reason)) if finished else None
        return {"index": j, "text": text, "logprobs": lp, "finish_reason": finish}

    def _logprobs(self, j: int, c: Any, echoed: bool) -> dict[str, list[Any]]:
        i, parts = j // self.n, []
        if echoed and i in self.prompt_lps:  # echo with logprobs: the prompt's come first
            parts.append(echo_logprobs(self.prompt_lps[i], self.p.tokens_as_ids))
            self.offsets[j] = len(self.echo[i])
        if not self.p.prompt_only:
            own = completion_logprobs(c, self.p.tokens_as_ids, self.offsets[j])
            if c.token_ids and c.tokens:
                self.offsets[j] = own["text_offset"][-1] + len(c.tokens[-1])
            parts.append(own)
        return {k: [x for part in parts for x in part[k]] for k in _LP_KEYS}

    def usage(self, u: Any) -> dict[str, Any]:
        d = usage(u)
        if self.p.prompt_only:  # the token asked of the router is not part of the answer
            d["completion_tokens"], d["total_tokens"] = 0, d["prompt_tokens"]
        return d

    def envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.cid, "object": "text_completion", "created": int(time.time()), "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = usage
        return out

    def whole(self, comps: list[Any]) -> dict[str, Any]:
        total, out = zero_usage(), []
        for i, c in enumerate(comps):
            add_usage(total, self.usage(c.usage))
            self.take(i, c.prompt_logprobs)
            out += [self.choice(i * self.n + sub.index, sub, True) for sub in c.choices or [c]]
        return self.envelope(out, total)

    def frames(self, i: int, chunk: GenerateChunk) -> list[dict[str, Any]]:
        j = i * self.n + chunk.index
        self.take(i, chunk.prompt_logprobs)
        gen = not self.p.prompt_only
        lp_due = self.p.top_logprobs is not None and bool(chunk.token_ids)
        if not (gen and (chunk.text or lp_due)) and not chunk.finished and not self._echoes(j):
            return []
        return [self.envelope([self.choice(j, chunk, chunk.finished)])]

    def usage_frame(self, total: dict[str, int]) -> dict[str, Any]:
        if self.p.prompt_only:
            total = dict(total, completion_tokens=0, total_tokens=total["prompt_tokens"])
        return self.envelope([], total)


async def serve_completion(
    client: AsyncClient,
    request: web.Request,
    body: CompletionRequest,
    model_of: Callable[[str], Awaitable[str]],
) -> web.StreamResponse:
    """Answer one completions request; ``model_of``: the model name the response carries."""
    p, prompts = body.plan(), body.prompts()
    base = p.request_id or uuid.uuid4().hex
    run = CompletionRun(p, prompts, f"cmpl-{base}", "")
    streams = [
        client.generate_stream(
            pr, model=p.model, request_id=base if len(prompts) == 1 else f"{base}-{i}", **run.sampling(i)
        )
        for i, pr in enumerate(prompts)
    ]
    run.model = await model_of(p.model)
    if not p.stream:
        return web.json_response(run.whole(await gather(streams)))
    return await stream_sse(request, streams, run.frames, [], run.usage_frame if p.include_usage else None)
