"""pdserve Python SDK: a blocking :class:`Client` and an asyncio :class:`AsyncClient` for the router's gRPC API.

    from pdserve.client import Client

    with Client("127.0.0.1:50051") as c:
        out = c.generate("The capital of France is", max_tokens=8, temperature=0)
        print(out.text, out.usage.completion_tokens, out.timing.ttft_s)

Both clients: ``generate`` / ``chat`` (whole text), ``generate_stream`` / ``chat_stream`` (chunks, ``cancel()``),
``cancel(request_id)``, ``cluster_status()``, ``validate_config(...)``, per-call ``timeout=`` deadlines, retries on
UNAVAILABLE with exponential backoff before the first token, and typed exceptions (:mod:`pdserve.client.errors`).
"""

from pdserve.client.aio import AsyncClient, AsyncGenerateStream
from pdserve.client.errors import *  # noqa: F403
from pdserve.client.errors import __all__ as _errors_all
from pdserve.client.retry import NO_RETRY, RetryPolicy
from pdserve.client.sync import Client, GenerateStream
from pdserve.client.types import Completion, GenerateChunk, Routing, Timing, Usage

__all__ = [
    "Client",
    "AsyncClient",
    "GenerateStream",
    "AsyncGenerateStream",
    "Completion",
    "GenerateChunk",
    "Usage",
    "Timing",
    "Routing",
    "RetryPolicy",
    "NO_RETRY",
    *_errors_all,
]
