"""pdserve.v1 SamplingParams -> the engine's SamplingParams (pdserve/sampling_params.py, where every rule about the
values lives), for the router and both pods alike.

The router builds ``requested_params`` from each request before any pod is contacted (router/core.py), so a client
gets one clean INVALID_ARGUMENT, with the same message whichever service it talks to. Every field of the message is
implemented by the pods (common.proto: a field a server does not implement is refused, never ignored)."""

from __future__ import annotations

from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.structured import StructuredOutputError, StructuredSpec
from pdserve_api.v1 import common_pb2 as pb


def structured_spec(sp: pb.SamplingParams) -> StructuredSpec | None:
    """The request's output constraint, None when unset. Raises SamplingParamsError for a malformed one (an invalid
    schema / regex / grammar is found when it is compiled)."""
    if not sp.HasField("structured_output"):
        return None
    so = sp.structured_output
    kind = so.WhichOneof("constraint")
    try:
        if kind is None:
            raise StructuredOutputError("set one of json_schema, json_object, regex, choice or grammar")
        if kind == "json_object":
            if not so.json_object:
                raise StructuredOutputError("json_object must be true when it is the constraint")
            return StructuredSpec("json_object")
        if kind == "choice":
            return StructuredSpec("choice", tuple(so.choice.values))
        return StructuredSpec(kind, getattr(so, kind))
    except StructuredOutputError as e:
        raise SamplingParamsError(f"structured_output: {e}") from None


def num_sequences(sp: pb.SamplingParams) -> int:
    """Sequences a pod generates for the request: best_of when set (the router keeps the best n), else n.
    Raises SamplingParamsError for values out of range (the engine bounds n itself)."""
    if sp.n < 0 or sp.best_of < 0:
        raise SamplingParamsError(f"n and best_of must be >= 1 (0: unset), got n={sp.n}, best_of={sp.best_of}")
    n = max(sp.n, 1)
    if sp.best_of and sp.best_of < n:
        raise SamplingParamsError(f"best_of must be greater than or equal to n, got n={n} and best_of={sp.best_of}.")
    return max(n, sp.best_of)


# max_tokens unset: no bound from the request (the context length bounds the output; the router checks min_tokens
# against it).
_UNBOUNDED = 2**31 - 1


def requested_params(sp: pb.SamplingParams) -> SamplingParams:
    """The request's sampling as the client sent it (max_tokens included), as the engine's SamplingParams: building
    it checks every value. Raises SamplingParamsError naming the first bad one."""
    return engine_params(
        sp,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else _UNBOUNDED,
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        stop=list(sp.stop),
    )


def engine_params(
    sp: pb.SamplingParams,
    max_tokens: int,
    ignore_eos: bool,
    logprobs: bool,
    min_tokens: int | None = None,
    stop: list[str] | None = None,
) -> SamplingParams:
    """The engine's SamplingParams from the proto's sampling fields (the caller decides the stop rules: stop strings
    are matched by whoever detokenizes, the router). Raises SamplingParamsError for values out of range."""
    return SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_k=sp.top_k,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=max_tokens,
        stop=stop or [],
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs or sp.top_logprobs > 0,
        top_logprobs=sp.top_logprobs,
        min_tokens=sp.min_tokens if min_tokens is None else min_tokens,
        min_p=sp.min_p if sp.HasField("min_p") else 0.0,
        presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
        frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(sp.logit_bias),
        structured=structured_spec(sp),
    )
