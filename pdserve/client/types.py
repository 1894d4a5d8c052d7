"""Response types of the SDK (plain dataclasses) and the request builder shared by the sync and async clients."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

from pdserve_api.v1 import common_pb2, router_pb2

# What a prompt may be: text, or token ids used verbatim.
Prompt = Union[str, Sequence[int]]
# A chat message: {"role": ..., "content": ...}, or a (role, content) pair.
Message = Union[Mapping[str, Any], Sequence[str]]

_FINISH_NAMES: dict[int, str | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason_name(value: int) -> str | None:
    """``"stop"``, ``"length"``, ``"cancelled"``, ``"error"``, or None (not finished)."""
    return _FINISH_NAMES.get(value, common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_proto(cls, u: common_pb2.Usage) -> "Usage":
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


@dataclass(frozen=True)
class Timing:
    """Latency breakdown in seconds. The server fields are measured by the router; ``client_ttft_s`` and
    ``client_e2e_s`` by this SDK (request sent -> first token / final message received, retries included)."""

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_s: float = 0.0
    mean_tpot_s: float = 0.0
    client_ttft_s: float | None = None
    client_e2e_s: float | None = None

    @classmethod
    def from_proto(
        cls, t: common_pb2.Timing, client_ttft_s: float | None = None, client_e2e_s: float | None = None
    ) -> "Timing":
        return cls(
            t.ttft_s,
            t.e2e_s,
            t.queue_s,
            t.prefill_s,
            t.kv_transfer_s,
            t.decode_s,
            t.mean_tpot_s,
            client_ttft_s,
            client_e2e_s,
        )


@dataclass(frozen=True)
class Routing:
    prefill_pod_id: str = ""
    decode_pod_id: str = ""
    transfer_mode: str = ""

    @classmethod
    def from_proto(cls, r: router_pb2.RoutingInfo) -> "Routing":
        mode = common_pb2.TransferMode.Name(r.transfer_mode).removeprefix("TRANSFER_MODE_").lower()
        return cls(r.prefill_pod_id, r.decode_pod_id, "" if mode == "unspecified" else mode)


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: the tokens (and their text) produced since the previous one. The last chunk of a
    stream has ``finish_reason`` set and carries ``usage``, ``timing`` and ``routing``."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    usage: Usage | None = None
    timing: Timing | None = None
    routing: Routing | None = None
    prompt_token_ids: list[int] | None = None
    error_message: str = ""
    tokens: list[str] = field(default_factory=list)  # each token's own text, when logprobs are returned
    top_tokens: list[dict[int, str]] = field(default_factory=list)  # the text of each top_logprobs alternative
    index: int = 0  # which of the request's n sequences (n > 1); each ends with its own finished chunk
    prompt_logprobs: PromptLogprobs | None = None  # first chunk, when prompt_logprobs was asked for

    @property
    def finished(self) -> bool:
        """This chunk ends its sequence (with n == 1: the request)."""
        return self.finish_reason is not None


@dataclass
class PromptLogprobs:
    """The prompt's tokens with their logprobs (position 0 has none: None) and top alternatives."""

    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    top_tokens: list[dict[int, str] | None]

    @classmethod
    def from_proto(cls, p: common_pb2.PromptLogprobs) -> "PromptLogprobs":
        return cls(
            list(p.token_ids),
            list(p.tokens),
            [None, *p.logprobs],
            [None, *(dict(zip(t.token_ids, t.logprobs)) for t in p.top_logprobs)],
            [None, *(dict(zip(t.token_ids, t.tokens)) for t in p.top_logprobs)],
        )


@dataclass
class Completion:
    """A whole generation: the text, its tokens, why it ended, token counts and timing."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    timing: Timing = field(default_factory=Timing)
    routing: Routing = field(default_factory=Routing)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_token_ids: list[int] | None = None
    error_message: str = ""
    tokens: list[str] | None = None  # each token's own text, when logprobs were asked for
    top_tokens: list[dict[int, str]] | None = None  # the text of each top_logprobs alternative
    # n > 1: every sequence's completion in index order (the fields above are choice 0's, usage the request's).
    choices: list[Completion] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    index: int = 0

    @property
    def ttft_s(self) -> float:
        """Time to first token as measured by the router."""
        return self.timing.ttft_s


class CompletionBuilder:
    """Accumulates chunks into a Completion (used by the streams and by the whole-text calls)."""

    def __init__(self, request_id: str, n: int = 1) -> None:
        self.request_id = request_id
        self.n = n
        self.subs: dict[int, CompletionBuilder] = {}  # n > 1: one builder per sequence
        self.ended: set[int] = set()
        self.prompt_logprobs: PromptLogprobs | None = None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.tokens: list[str] = []
        self.top_tokens: list[dict[int, str]] = []
        self.want_logprobs = False
        self.prompt_token_ids: list[int] | None = None
        self.last: GenerateChunk | None = None

    def add(self, c: GenerateChunk) -> bool:
        """Take a chunk; True when it ends the request (every sequence ended, or a cancel / error ended all)."""
        if c.prompt_logprobs is not None:
            self.prompt_logprobs = c.prompt_logprobs
        if self.n == 1:
            self._add(c)
            return c.finished
        self.subs.setdefault(c.index, CompletionBuilder(self.request_id))._add(c)
        if c.index == 0:
            self._add(c)
            self.last = None
        if c.finished:
            self.ended.add(c.index)
        if c.finished and (len(self.ended) >= self.n or c.finish_reason in ("cancelled", "error")):
            self.last = c
            return True
        return False

    def _add(self, c: GenerateChunk) -> None:
        self.request_id = c.request_id or self.request_id
        self.text_parts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.want_logprobs = True
            self.logprobs.extend(c.logprobs)
        self.top_logprobs.extend(c.top_logprobs)
        self.tokens.extend(c.tokens)
        self.top_tokens.extend(c.top_tokens)
        if c.prompt_token_ids is not None:
            self.prompt_token_ids = c.prompt_token_ids
        if c.finished:
            self.last = c

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def build(
        self, finish_reason: str | None = None, client_ttft_s: float | None = None, client_e2e_s: float | None = None
    ) -> Completion:
        last = self.last
        # A sequence that never ended on its own (the request was cancelled / failed) takes the request's reason.
        fallback = finish_reason if finish_reason is not None else (last.finish_reason if last else None)
        first = self.subs.get(0)
        if self.n > 1 and finish_reason is None and first is not None and first.last is not None:
            finish_reason = first.last.finish_reason  # the top-level fields are choice 0's
        usage = (
            last.usage if last is not None and last.usage is not None else Usage(completion_tokens=len(self.token_ids))
        )
        timing = last.timing if last is not None and last.timing is not None else Timing()
        timing = Timing(**{**timing.__dict__, "client_ttft_s": client_ttft_s, "client_e2e_s": client_e2e_s})
        return Completion(
            request_id=self.request_id,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=finish_reason if finish_reason is not None else (last.finish_reason if last else None),
            stop_reason=last.stop_reason if last else "",
            usage=usage,
            timing=timing,
            routing=last.routing if last is not None and last.routing is not None else Routing(),
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            top_logprobs=list(self.top_logprobs) if self.top_logprobs else None,
            prompt_token_ids=self.prompt_token_ids,
            error_message=last.error_message if last else "",
            tokens=list(self.tokens) if self.want_logprobs else None,
            top_tokens=list(self.top_tokens) if self.top_tokens else None,
            choices=None if self.n == 1 else [self._choice(i, fallback) for i in range(self.n)],
            prompt_logprobs=self.prompt_logprobs,
        )

    def _choice(self, i: int, finish_reason: str | None) -> Completion:
        sub = self.subs.get(i) or CompletionBuilder(self.request_id)
        own = sub.last.finish_reason if sub.last is not None else finish_reason
        c = sub.build(own)
        c.index = i
        c.usage = Usage(completion_tokens=len(c.token_ids))
        return c


def chunk_from_proto(
    m: router_pb2.GenerateResponse, client_ttft_s: float | None = None, client_e2e_s: float | None = None
) -> GenerateChunk:
    final = m.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return GenerateChunk(
        request_id=m.request_id,
        token_ids=list(m.token_ids),
        text=m.text,
        logprobs=list(m.logprobs),
        top_logprobs=[dict(zip(t.token_ids, t.logprobs)) for t in m.top_logprobs],
        finish_reason=finish_reason_name(m.finish_reason),
        stop_reason=m.stop_reason,
        usage=Usage.from_proto(m.usage) if final and m.HasField("usage") else None,
        timing=Timing.from_proto(m.timing, client_ttft_s, client_e2e_s) if final and m.HasField("timing") else None,
        routing=Routing.from_proto(m.routing) if final and m.HasField("routing") else None,
        index=m.index,
        prompt_logprobs=(PromptLogprobs.from_proto(m.prompt_logprobs) if m.HasField("prompt_logprobs") else None),
        prompt_token_ids=list(m.prompt_token_ids) if len(m.prompt_token_ids) else None,
        error_message=m.error_message,
        tokens=list(m.tokens),
        top_tokens=[dict(zip(t.token_ids, t.tokens)) for t in m.top_logprobs],
    )


# ----------------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------------

_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
    "ignore_eos",
    "top_logprobs",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
    "min_p",
    "logit_bias",
    "n",
    "best_of",
    "prompt_logprobs",
    "structured_output",
)


def structured_output(value: Any) -> common_pb2.StructuredOutput:
    """A StructuredOutput from a dict with one key: ``{"json_schema": dict | str}``, ``{"json_object": True}``,
    ``{"regex": str}``, ``{"choice": [str, ...]}`` or ``{"grammar": str}`` (EBNF); a StructuredOutput passes through."""
    if isinstance(value, common_pb2.StructuredOutput):
        return value
    if not isinstance(value, Mapping) or len(value) != 1:
        raise TypeError(
            "structured_output must be a dict with exactly one of json_schema, json_object, regex, choice, grammar"
        )
    ((kind, v),) = value.items()
    so = common_pb2.StructuredOutput()
    if kind == "json_schema":
        so.json_schema = v if isinstance(v, str) else json.dumps(v)
    elif kind == "json_object":
        so.json_object = bool(v)
    elif kind == "choice":
        if isinstance(v, str):
            raise TypeError("structured_output choice must be a list of strings")
        so.choice.values.extend(str(c) for c in v)
    elif kind in ("regex", "grammar"):
        setattr(so, kind, str(v))
    else:
        raise TypeError(
            f"unknown structured_output kind {kind!r}; use json_schema, json_object, regex, choice or grammar"
        )
    return so


def sampling_params(**kw: Any) -> common_pb2.SamplingParams:
    """SamplingParams from keyword arguments; None means "unset" (the server's default)."""
    unknown = set(kw) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s): {', '.join(sorted(unknown))}; known: {', '.join(_SAMPLING_FIELDS)}"
        )
    sp = common_pb2.SamplingParams()
    for name, value in kw.items():
        if value is None:
            continue
        if name == "stop":
            sp.stop.extend([value] if isinstance(value, str) else list(value))
        elif name == "stop_token_ids":
            sp.stop_token_ids.extend(int(v) for v in value)
        elif name == "logit_bias":
            sp.logit_bias.update({int(k): float(v) for k, v in dict(value).items()})
        elif name == "structured_output":
            sp.structured_output.CopyFrom(structured_output(value))
        else:
            setattr(sp, name, value)
    return sp


def new_request_id() -> str:
    return "sdk-" + uuid.uuid4().hex


def chat_message(m: Message) -> router_pb2.ChatMessage:
    """A ChatMessage from an OpenAI-style dict (role, content, and tool_calls / tool_call_id / name) or a
    (role, content) pair. Tool-call arguments may be JSON text or an object."""
    if not isinstance(m, Mapping):
        role, content = m
        return router_pb2.ChatMessage(role=str(role), content=str(content))
    msg = router_pb2.ChatMessage(
        role=str(m["role"]),
        content=str(m.get("content") or ""),
        tool_call_id=str(m.get("tool_call_id") or ""),
        name=str(m.get("name") or ""),
    )
    for c in m.get("tool_calls") or ():
        fn = c.get("function", c)
        args = fn.get("arguments", "")
        msg.tool_calls.add(
            id=str(c.get("id") or ""),
            name=str(fn.get("name") or ""),
            arguments=args if isinstance(args, str) else json.dumps(args),
        )
    return msg


def build_generate_request(
    *,
    prompt: Prompt | None = None,
    messages: Iterable[Message] | None = None,
    add_generation_prompt: bool | None = None,
    model: str = "",
    request_id: str | None = None,
    return_prompt_token_ids: bool = False,
    params: common_pb2.SamplingParams | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> router_pb2.GenerateRequest:
    """tools (chat only): OpenAI tool objects, passed to the model's chat template."""
    req = router_pb2.GenerateRequest(
        request_id=request_id or new_request_id(), model=model or "", return_prompt_token_ids=return_prompt_token_ids
    )
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt or messages")
    if messages is not None:
        chat = router_pb2.ChatPrompt(
            messages=[chat_message(m) for m in messages], tools_json=json.dumps(list(tools)) if tools else ""
        )
        if add_generation_prompt is not None:
            chat.add_generation_prompt = add_generation_prompt
        req.chat.CopyFrom(chat)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        assert prompt is not None  # exactly one of prompt and messages, checked above
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(int(t) for t in prompt)
    if params is not None:
        req.sampling_params.CopyFrom(params)
    return req
