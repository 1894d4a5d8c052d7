"""Tool-call parsers: the model's text -> OpenAI's tool_calls, one per model family (vLLM's --tool-call-parser).

``hermes``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, and the
SmolLM / ChatML family's function-calling format); text before the first call is the message's content."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


class ToolParser:
    """Splits a finished message into (content, tool calls); start_marker tells a stream when to hold text back."""

    start_marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.start_marker not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return text, []  # a malformed call is left as text, as vLLM's parser does
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args)))
        content = text[: text.index(self.start_marker)].strip()
        return content or None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {known}") from None


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of {"name", "parameters"} calls, one of the tools each (vLLM's schema;
    parallel_tool_calls false allows one call)."""

    def one(t: dict[str, Any]) -> dict[str, Any]:
        fn = t["function"]
        return {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [fn["name"]]},
                "parameters": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }

    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [one(t) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_required(text: str) -> list[ParsedToolCall]:
    """The calls of a tool_choice "required" output (a JSON array constrained by required_schema)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [
        ParsedToolCall(c["name"], json.dumps(c.get("parameters", {})))
        for c in items
        if isinstance(c, dict) and isinstance(c.get("name"), str)
    ]
