"""A ChatPrompt as the chat template sees it: transformers' message dicts (tool calls with their arguments as objects,
as vLLM hands them to templates) and the tool definitions."""

from __future__ import annotations

import json
from typing import Any

from pdserve.errors import InvalidArgument
from pdserve_api.v1 import router_pb2

ROLES = ("system", "user", "assistant", "tool")


def template_inputs(chat: router_pb2.ChatPrompt) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for Tokenizer.apply_chat_template; raises InvalidArgument naming the bad field."""
    msgs: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"chat message {i} has role {m.role!r}; use system, user, assistant or tool")
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.arguments) if c.arguments else {}
                except json.JSONDecodeError as e:
                    raise InvalidArgument(
                        f"chat message {i}: tool_calls[{j}].arguments is not valid JSON: {e}"
                    ) from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        msgs.append(d)
    tools = None
    if chat.tools_json:
        try:
            tools = json.loads(chat.tools_json)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"chat tools_json is not valid JSON: {e}") from None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidArgument("chat tools_json must be a JSON list of tool objects")
    return msgs, tools
