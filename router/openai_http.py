"""OpenAI-compatible HTTP API in front of the router: /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, /health, and its OpenAPI document at /openapi.json. The code lives in the router.openai
package (protocol, serving per endpoint, app, cli); this module is its entry point and keeps the names callers use:

    python -m router.openai_http --router 127.0.0.1:50051 --port 8000

Every request goes through the router's own gRPC Generate path (the pdserve AsyncClient over a channel to the
router), so HTTP and gRPC outputs are the same for the same request. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with the HTTP status that matches the router's gRPC status.

HTTPS: ``--http-tls-cert-file`` / ``--http-tls-key-file`` (this server's certificate; add ``--http-tls-ca-file`` and
``--http-tls-require-client-cert`` for mutual TLS), env ``PDSERVE_HTTP_TLS_*``. The ``--tls-*`` flags are the client
side: how this front reaches a router that serves TLS.

Supported request fields: model, prompt (text, token ids, or a list of either) / messages (text content or text
parts), max_tokens / max_completion_tokens, temperature, top_p, seed, stop, presence_penalty, frequency_penalty,
logit_bias, logprobs (completions: an int; chat: a bool with top_logprobs), echo (completions, text or token-id
prompts; with logprobs the prompt tokens' logprobs too; with max_tokens 0 the prompt only, scored), n (the prompt is
prefilled once for all n), best_of (completions, not streamed), stream, stream_options.include_usage, user
(ignored), plus vLLM's extras top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
skip_special_tokens, return_tokens_as_token_ids. Structured output: response_format (text, json_object,
json_schema) and vLLM's guided_json, guided_regex, guided_choice, guided_grammar (guided_decoding_backend
"xgrammar"), on both endpoints. Chat tools: tools, tool_choice (none, auto, required, a named function) and
parallel_tool_calls; tools go to the chat template, calls come back as tool_calls (parsed with the
--tool-call-parser; with required or a named function the arguments are constrained by the function's JSON schema).
Any other field is refused with a 400 naming it, rather than silently ignored; so are the deprecated functions /
function_call and a non-empty suffix.
"""

from __future__ import annotations

import sys

from router.openai.app import OpenAIHttpServer, start_openai_http
from router.openai.cli import main, parser
from router.openai.errors import ApiError, bad
from router.openai.protocol import Parsed, parse_chat, parse_completion

__all__ = [
    "ApiError",
    "OpenAIHttpServer",
    "Parsed",
    "bad",
    "main",
    "parse_chat",
    "parse_completion",
    "parser",
    "start_openai_http",
]

if __name__ == "__main__":
    sys.exit(main())
