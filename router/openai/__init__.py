"""pdserve's OpenAI-compatible HTTP front, split the way vLLM's entrypoints/openai is:

- ``protocol``: the request and response bodies as pydantic models (unknown fields refused), and what a request
  asks of the router (sampling fields, prompts, messages);
- ``errors``: OpenAI's error shape, gRPC statuses and pydantic validation errors mapped onto it;
- ``logprobs``: OpenAI's logprobs and usage objects built from the router's answers;
- ``streaming``: SSE framing, gathering and merging the router's streams;
- ``serving_completion`` / ``serving_chat``: one module per endpoint;
- ``openapi``: the OpenAPI document served at ``/openapi.json``, made from the protocol models;
- ``app``: the aiohttp application, its routes and listening site; ``cli``: ``python -m router.openai_http``.
"""
