"""POST /v1/chat/completions: the messages (and tools) go to the router's chat template; the answer comes back
whole or streamed, with tool calls parsed out of the text (tool_choice auto: the --tool-call-parser's markers;
required / a named function: the constrained JSON itself)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from pdserve.client import AsyncClient
from pdserve.client.types import GenerateChunk
from router.openai.logprobs import chat_logprobs, finish_reason, usage
from router.openai.protocol import ChatCompletionRequest, Parsed
from router.openai.streaming import gather, stream_sse
from router.tool_parsers import ParsedToolCall, ToolParser, calls_from_required


class ChatRun:
    """One chat request's answer, built from its stream's chunks or its completion."""

    def __init__(self, p: Parsed, cid: str, model: str, parser: ToolParser) -> None:
        self.p, self.cid, self.model, self.parser = p, cid, model, parser
        self.want_lp = p.top_logprobs is not None
        self.text_so_far: dict[int, str] = {}  # per choice: all its text (with tools: held back until parsed)
        self.sent: dict[int, int] = {}  # per choice: how much of that text went out

    def finish_of(self, reason: str | None, calls: list[dict[str, Any]]) -> str | None:
        finish = finish_reason(reason)
        # OpenAI: a call the model chose (auto / required) ends with "tool_calls"; a named one with "stop".
        return "tool_calls" if calls and finish == "stop" and self.p.tool_choice != "function" else finish

    def tool_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content and OpenAI tool_calls for a finished generation."""
        if self.p.tool_choice == "auto":
            content, parsed = self.parser.parse(text)
        elif self.p.tool_choice == "required":
            parsed = calls_from_required(text)
            content = None if parsed else text  # a truncated array stays visible as text
        elif self.p.tool_choice == "function":
            content, parsed = None, [ParsedToolCall(self.p.tool_name, text)]
        else:
            return text, []
        return content, [c.openai() for c in parsed]

    def choice(self, c: Any) -> dict[str, Any]:
        """One finished choice: its message (tool calls parsed out of the text) and finish reason."""
        content, calls = self.tool_calls(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c, self.p.tokens_as_ids) if self.want_lp else None,
            "finish_reason": self.finish_of(c.finish_reason, calls),
        }

    def whole(self, c: Any) -> dict[str, Any]:
        out = {"id": self.cid, "object": "chat.completion", "created": int(time.time()), "model": self.model}
        return {**out, "choices": [self.choice(ch) for ch in c.choices or [c]], "usage": usage(c.usage)}

    def chunk(self, delta: dict[str, Any], finish: str | None, lp: Any = None, index: int = 0) -> dict[str, Any]:
        return {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }

    def head(self) -> list[dict[str, Any]]:
        return [self.chunk({"role": "assistant", "content": ""}, None, index=k) for k in range(self.p.n)]

    def usage_frame(self, total: dict[str, int]) -> dict[str, Any]:
        return {**self.chunk({}, None), "choices": [], "usage": total}

    def frames(self, i: int, c: GenerateChunk) -> list[dict[str, Any]]:
        return self._plain_frames(c) if self.p.tool_choice == "none" else self._tool_frames(c)

    def _plain_frames(self, c: GenerateChunk) -> list[dict[str, Any]]:
        out = []
        if c.text or (self.want_lp and c.token_ids):
            lp = chat_logprobs(c, self.p.tokens_as_ids) if self.want_lp else None
            out.append(self.chunk({"content": c.text}, None, lp, c.index))
        if c.finished:
            out.append(self.chunk({}, finish_reason(c.finish_reason), index=c.index))
        return out

    def _tool_frames(self, c: GenerateChunk) -> list[dict[str, Any]]:
        """With tools: auto streams text until a call may be starting (held back from a possible marker on);
        required / named calls, and every call, go out whole when the generation ends. Per choice index."""
        k, out = c.index, []
        self.text_so_far[k] = full = self.text_so_far.get(k, "") + c.text
        done = self.sent.get(k, 0)
        marker = self.parser.start_marker
        if self.p.tool_choice == "auto" and not c.finished and marker not in full:
            upto = len(full)
            for j in range(1, len(marker)):
                if full.endswith(marker[:j]):
                    upto = len(full) - j
            if upto > done:
                out.append(self.chunk({"content": full[done:upto]}, None, index=k))
                self.sent[k] = done = upto
        if not c.finished:
            return out
        content, calls = self.tool_calls(full)
        rest = content[done:] if calls and content else ("" if calls else full[done:])
        if rest:
            out.append(self.chunk({"content": rest}, None, index=k))
        if calls:
            out.append(self.chunk({"tool_calls": [dict(t, index=j) for j, t in enumerate(calls)]}, None, index=k))
        out.append(self.chunk({}, self.finish_of(c.finish_reason, calls), index=k))
        return out


async def serve_chat(
    client: AsyncClient,
    request: web.Request,
    body: ChatCompletionRequest,
    model_of: Callable[[str], Awaitable[str]],
    parser: ToolParser,
) -> web.StreamResponse:
    """Answer one chat request; ``model_of``: the model name the response carries."""
    p = body.plan()
    rid = p.request_id or uuid.uuid4().hex
    stream = client.chat_stream(
        body.for_router(),
        add_generation_prompt=body.add_generation_prompt,
        model=p.model,
        request_id=rid,
        tools=p.tools,
        **p.sampling,
    )
    run = ChatRun(p, f"chatcmpl-{rid}", await model_of(p.model), parser)
    if not p.stream:
        (c,) = await gather([stream])
        return web.json_response(run.whole(c))
    return await stream_sse(request, [stream], run.frames, run.head(), run.usage_frame if p.include_usage else None)
