"""The OpenAI API's request and response bodies as pydantic models (after vLLM's entrypoints/openai/protocol.py),
and what a request asks of the router.

Requests are strict: a field this server does not know is refused (``extra="forbid"``; OpenAI's own server does
the same), and types are not coerced (``"n": true`` or ``"max_tokens": 1.5`` is a 400, not 1). A JSON ``null`` is
the field's default. ``SHAPES`` says, for the fields whose type is a union, what they take, so a refusal reads as
one sentence rather than pydantic's list of union members (errors.from_validation). Checks across fields raise
ApiError from the model's validator, naming the field.

Responses are declared for the OpenAPI document (openapi.py) and for clients and fuzzers that check answers
against it; the serving modules build the same shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from pdserve.engine.config import MAX_N
from router.openai.errors import bad, from_validation
from router.tool_parsers import required_schema

Num = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # an int is a number too; a bool or "1" is not
# Integer widths of the router's protobuf fields: a wider value is refused here rather than failing to encode.
Int32 = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Listed = AfterValidator(lambda v: [v])  # one of something, as the list of them the code takes
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_SAMPLING = {
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "seed",
    "top_k",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A nested object whose other keys are passed on or ignored, as OpenAI's clients send more than is read."""

    model_config = ConfigDict(extra="allow")


# --- shared pieces --------------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


class JsonSchemaFormat(_Open):
    name: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Open):
    name: NonEmptyStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Open):
    name: StrictStr


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Open):
    name: StrictStr
    arguments: StrictStr = ""


class ToolCall(_Open):
    function: FunctionCall


class TextPart(_Open):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # text parts are joined: the template takes one string
    content: StrictStr | Annotated[list[TextPart], AfterValidator(lambda ps: "".join(p.text for p in ps))] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def for_router(self) -> dict[str, Any]:
        """The message as the router's chat template takes it: developer is system, content is its text."""
        msg: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content or "",
        }
        if self.tool_calls is not None:
            msg["tool_calls"] = [c.model_dump(exclude_unset=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


@dataclass
class Parsed:
    """What a request asks of the router and of the response, read from its model."""

    model: str
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    request_id: str | None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    top_logprobs: int | None = None  # None: no logprobs in the response
    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing generated (vLLM's rule)
    tools: list[dict[str, Any]] | None = None  # what the chat template gets (None: tool_choice none / no tools)
    tool_choice: str = "none"  # none, auto, required, or "function" (named)
    tool_name: str = ""  # the named function
    n: int = 1

    def want_logprobs(self, k: int) -> None:
        self.top_logprobs = k
        self.sampling["logprobs"] = True
        self.sampling["top_logprobs"] = k


_SCHEMA_OBJECT: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


def _json_schema(text: str) -> dict[str, Any]:
    """guided_json given as JSON text: the schema object it holds."""
    try:
        return _SCHEMA_OBJECT.validate_json(text)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad(f"guided_json is not valid JSON: {err['ctx'].get('error', err['msg'])}", "guided_json") from None
        raise bad("guided_json must be a JSON schema object", "guided_json") from None


class _Request(_Strict):
    """Fields both endpoints take: OpenAI's sampling fields, vLLM's extra ones, structured output."""

    SHAPES: ClassVar[dict[str, str]] = {
        "n": f"'n' must be an integer in [1, {MAX_N}]",
        "stop": "'stop' must be a string or a list of strings",
        "stop_token_ids": "'stop_token_ids' must be a list of integers",
        "logit_bias": "'logit_bias' must be an object mapping token ids to biases (numbers)",
        "request_id": "'request_id' must be a non-empty string",
        "response_format": "response_format.type must be one of text, json_object, json_schema (json_schema: "
        "with a json_schema object holding a 'schema' object)",
        "guided_json": "guided_json must be a JSON schema object (or its JSON text)",
        "guided_choice": "guided_choice must be a non-empty list of strings",
        "guided_regex": "guided_regex must be a non-empty string",
        "guided_grammar": "guided_grammar must be a non-empty string",
    }

    model: StrictStr | None = None
    max_tokens: Int32 | None = None
    temperature: Num | None = None
    top_p: Num | None = None
    seed: Int64 | None = None
    stop: Annotated[StrictStr, Listed] | list[StrictStr] | None = None
    presence_penalty: Num | None = None
    frequency_penalty: Num | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, Num] | None = None
    # vLLM's extensions
    top_k: Int32 | None = None
    min_p: Num | None = None
    min_tokens: Int32 | None = None
    repetition_penalty: Num | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Int32] | None = None
    skip_special_tokens: StrictBool | None = None
    request_id: NonEmptyStr | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    response_format: ResponseFormat | None = None
    guided_json: Annotated[StrictStr, AfterValidator(_json_schema)] | dict[str, Any] | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None
    guided_decoding_backend: StrictStr | None = None

    @model_validator(mode="after")
    def _across_fields(self) -> "_Request":
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        for k in self.logit_bias or {}:
            try:
                ok = 0 <= int(k) < 2**31
            except ValueError:
                ok = False
            if not ok:
                raise bad(f"logit_bias key {k!r} is not a token id (an integer >= 0)", "logit_bias")
        if self.guided_decoding_backend not in (None, "xgrammar"):
            raise bad(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; this server uses xgrammar",
                "guided_decoding_backend",
            )
        self.structured()  # refuses two kinds at once, or guided_json that is not JSON
        return self

    def structured(self) -> dict[str, Any] | None:
        """The SDK's structured_output from response_format or vLLM's guided_* fields (one of them at most)."""
        given = [k for k in GUIDED if getattr(self, k) is not None]
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise bad(f"only one kind of structured output may be given, got {', '.join(given)}", given[1])
        if not given:
            return None
        if rf is not None and given[0] == "response_format":
            if rf.type == "json_object":
                return {"json_object": True}
            if rf.json_schema is None:
                raise bad(
                    "response_format json_schema needs a json_schema object with a 'schema' object", "response_format"
                )
            return {"json_schema": rf.json_schema.schema_}
        if self.guided_json is not None:
            return {"json_schema": self.guided_json}
        if self.guided_choice is not None:
            return {"choice": self.guided_choice}
        return {"regex": self.guided_regex} if self.guided_regex is not None else {"grammar": self.guided_grammar}

    def parsed(self, max_tokens: int | None) -> Parsed:
        s: dict[str, Any] = self.model_dump(include=_SAMPLING, exclude_none=True)
        if max_tokens is not None:
            s["max_tokens"] = max_tokens
        if self.stop:
            s["stop"] = self.stop
        if self.logit_bias:
            s["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        structured = self.structured()
        if structured is not None:
            s["structured_output"] = structured
        n = self.n or 1
        if n > 1:
            s["n"] = n
        return Parsed(
            model=self.model or "",
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            sampling=s,
            request_id=self.request_id,
            n=n,
            tokens_as_ids=bool(self.return_tokens_as_token_ids),
        )


# --- /v1/completions ------------------------------------------------------------------------------------------
# Always a list of prompts once validated: one text or one token-id list is a batch of one.
Prompt = Union[
    Annotated[NonEmptyStr, Listed],
    Annotated[TokenIds, Listed],
    Annotated[list[StrictStr], Field(min_length=1)],
    Annotated[list[TokenIds], Field(min_length=1)],
]


class CompletionRequest(_Request):
    """POST /v1/completions."""

    SHAPES: ClassVar[dict[str, str]] = {
        **_Request.SHAPES,
        "prompt": "'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        "best_of": f"best_of must be an integer in [n, {MAX_N}]",
    }

    prompt: Prompt
    max_tokens: Int32 | None = 16  # OpenAI's default
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] | None = None
    best_of: Int32 | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _completion_fields(self) -> "CompletionRequest":
        n = self.n or 1
        if self.best_of is not None:
            if not n <= self.best_of <= MAX_N:
                raise bad(f"best_of must be an integer in [n, {MAX_N}] (n={n}), got {self.best_of!r}", "best_of")
            if self.best_of > n and self.stream:
                raise bad("best_of > n cannot be streamed: the best sequences are known only when all end", "best_of")
        if self.suffix:
            raise bad("suffix is not supported", "suffix")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per entry of a batch."""
        return cast(list[Union[str, list[int]]], list(self.prompt))

    def plan(self) -> Parsed:
        prompt_only = bool(self.echo) and self.max_tokens == 0
        # The router generates at least one token; echo with max_tokens 0 asks for one and leaves it out.
        p = self.parsed(1 if prompt_only else self.max_tokens)
        p.echo, p.prompt_only = bool(self.echo), prompt_only
        if self.logprobs is not None:
            if p.echo:
                p.sampling["prompt_logprobs"] = self.logprobs
            p.want_logprobs(self.logprobs)
        if self.best_of is not None and self.best_of > p.n:
            p.sampling["best_of"] = self.best_of
        return p


# --- /v1/chat/completions -------------------------------------------------------------------------------------
ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    SHAPES: ClassVar[dict[str, str]] = {
        **_Request.SHAPES,
        "messages": "'messages' must be a non-empty list of message objects",
        "content": '{param} must be a string or a list of text parts ({{"type": "text", "text": ...}}): '
        "only text content parts are supported",
        "tool_calls": "{param} must be a list of tool calls with function.name and function.arguments (JSON text)",
        "tools": 'tools must be a list of {{"type": "function", "function": {{"name": ..., "parameters": '
        "{{a JSON schema object}}}}}}",
        "tool_choice": "tool_choice {value!r} is not one of none, auto, required or a named function "
        '({{"type": "function", "function": {{"name": ...}}}})',
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    functions: list[Any] | None = None  # deprecated by OpenAI: refused, naming what replaces them
    function_call: Any = None
    # OpenAI fields that do not change the answer: taken and ignored
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    reasoning_effort: StrictStr | None = None

    @model_validator(mode="after")
    def _chat_fields(self) -> "ChatCompletionRequest":
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad(f"{name} is deprecated and not supported; use tools and tool_choice", name)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        for i, m in enumerate(self.messages):
            _check_calls(i, m)
        mode, name = self.choice()
        names = [t.function.name for t in self.tools or []]
        if mode == "function" and name not in names:
            raise bad(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names) or 'none'})",
                "tool_choice",
            )
        given = self.tool_choice.model_dump() if mode == "function" else mode  # type: ignore[union-attr]
        if mode != "none" and not self.tools:
            raise bad(f"tool_choice {given!r} needs tools", "tool_choice")
        if mode in ("required", "function") and self.structured() is not None:
            raise bad(f"tool_choice {given!r} cannot be combined with response_format / guided decoding", "tool_choice")
        return self

    def choice(self) -> tuple[str, str]:
        """(none | auto | required | function, the named function's name): auto by default when tools are given."""
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            return "function", c.function.name
        return c or ("auto" if self.tools else "none"), ""

    def for_router(self) -> list[dict[str, Any]]:
        return [m.for_router() for m in self.messages]

    def plan(self) -> Parsed:
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        p = self.parsed(mt)
        if self.logprobs:
            p.want_logprobs(self.top_logprobs or 0)
        tools = [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None
        p.tool_choice, p.tool_name = self.choice()
        if p.tool_choice == "none":
            return p
        p.tools = tools
        if p.tool_choice == "required":
            p.sampling["structured_output"] = {
                "json_schema": required_schema(tools or [], self.parallel_tool_calls is not False)
            }
        elif p.tool_choice == "function":
            fn = next(t.function for t in self.tools or [] if t.function.name == p.tool_name)
            p.sampling["structured_output"] = {"json_schema": fn.parameters or {"type": "object"}}
        return p


def _check_calls(i: int, m: ChatMessage) -> None:
    """An assistant message's tool calls carry JSON arguments (the template renders them as JSON)."""
    if m.tool_calls is None:
        return
    if m.role != "assistant":
        raise bad(f"messages[{i}].tool_calls must be a list, on an assistant message", f"messages[{i}]")
    for j, c in enumerate(m.tool_calls):
        try:
            json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError as e:
            raise bad(
                f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                f"messages[{i}].tool_calls",
            ) from None


M = TypeVar("M", bound=_Strict)


def validate(model: type[M], body: Any) -> M:
    """``body`` as a ``model``, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e, body, getattr(model, "SHAPES", {})) from None


def parse_completion(body: Any) -> tuple[Parsed, list[str | list[int]]]:
    """A completions body -> what it asks of the router, and its prompts."""
    req = validate(CompletionRequest, body)
    return req.plan(), req.prompts()


def parse_chat(body: Any) -> tuple[Parsed, list[dict[str, Any]], bool | None]:
    """A chat body -> what it asks of the router, its messages for the template, add_generation_prompt."""
    req = validate(ChatCompletionRequest, body)
    return req.plan(), req.for_router(), req.add_generation_prompt


# --- responses (declared for the OpenAPI document) ------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str
