"""The prefill pod's reading of a request's sampling params: the first token's engine params, the client's stop
rules."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.pod.sampling import engine_params, num_sequences, requested_params
from pdserve.sampling_params import SamplingParams
from pdserve_api.v1 import common_pb2 as pb


@dataclass(frozen=True)
class ClientParams:
    """What the prefill pod needs from the client's sampling params besides sampling the first token."""

    max_tokens: int | None  # None: until EOS / context full
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    min_tokens: int = 0
    n: int = 1  # sequences sampled from the prompt's logits (SamplingParams n / best_of)
    prompt_logprobs: int | None = None


def sampling_from_proto(sp: pb.SamplingParams) -> tuple[SamplingParams, ClientParams]:
    """Engine params for sampling the first token (max_tokens=1) and the client-level stop rules.

    Stop strings are applied by whoever detokenizes (the router), so they are not used here. Raises
    SamplingParamsError for a value out of range: the request as the client sent it is checked first (max_tokens and
    min_tokens as given, not the one token sampled here), with the router's messages."""
    requested_params(sp)
    # The pod decides "finished" itself from ClientParams; the engine samples one token. The client's ignore_eos
    # and min_tokens (capped at that one token) tell the sampler whether to mask EOS / stop tokens.
    params = engine_params(sp, max_tokens=1, ignore_eos=sp.ignore_eos, logprobs=True, min_tokens=min(sp.min_tokens, 1))
    client = ClientParams(
        sp.max_tokens if sp.HasField("max_tokens") else None,
        frozenset(sp.stop_token_ids),
        sp.ignore_eos,
        sp.min_tokens,
        num_sequences(sp),
        sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
    )
    return params, client
