"""Structured output: a request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) and the
xgrammar token-bitmask machinery that applies it at sampling time, the same on the prefill pod (first token) and the
decode pod (every later token).

How the matcher's state crosses the prefill -> decode handoff: it is not serialized. The constraint's spec travels
in the request's SamplingParams (which both pods receive) and the tokens accepted so far are the request's output
tokens (decode gets the first token in DecodeRequest). A pod builds its own matcher from the spec (compiled once
per spec and tokenizer: xgrammar's GrammarCompiler caches) and replays the output tokens it has not fed yet before
every mask, so the first token sampled on prefill and the rest sampled on decode follow one grammar. Replay is also
what keeps a preempted-and-recomputed sequence's matcher right.

xgrammar (and torch) are imported on first use: a process that never sees a constraint does not pay for them."""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger("pdserve.structured")

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # one constraint's text; compiling is work the server does on the client's behalf
MAX_CHOICES = 1024
# Whitespace the JSON grammars allow between tokens: enough for indented output, not an endless run of newlines
# (a small model can otherwise spend every token on whitespace).
MAX_JSON_WHITESPACE = 16


class StructuredOutputError(ValueError):
    """An invalid constraint (bad JSON schema, regex or grammar); the message names the problem."""


@dataclass(frozen=True)
class StructuredSpec:
    """One request's output constraint. value: the JSON schema text (json_schema), the regex, the EBNF grammar, or
    the tuple of choices; "" for json_object."""

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            v = self.value
            if not isinstance(v, tuple) or not v or not all(isinstance(c, str) for c in v):
                raise StructuredOutputError("choice needs a non-empty list of strings")
            if len(v) > MAX_CHOICES:
                raise StructuredOutputError(f"choice may list at most {MAX_CHOICES} strings, got {len(v)}")
            size = sum(len(c) for c in v)
        elif self.kind == "json_object":
            size = 0
        else:
            if not isinstance(self.value, str) or not self.value.strip():
                raise StructuredOutputError(f"{self.kind} must be a non-empty string")
            size = len(self.value)
        if size > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"{self.kind} has {size} characters; at most {MAX_SPEC_CHARS} are allowed")
        if self.kind == "json_schema":
            assert isinstance(self.value, str)  # checked above
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("json_schema must be a JSON object (a JSON Schema)")

    @classmethod
    def json_schema(cls, schema: Any) -> "StructuredSpec":
        """From a schema given as a dict or as JSON text."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":")))


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _clean(e: Exception) -> str:
    """xgrammar's C++ errors start with "[time] file.cc:line: " (and "Check failed: ... is false: "): drop that."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: .*? is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(e).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the given strings (vLLM's choice_as_grammar)."""

    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


def _json_kwargs() -> dict[str, Any]:
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


@functools.lru_cache(maxsize=256)  # agents resend the same schema with every request; failures are not cached
def check_spec(spec: StructuredSpec) -> None:
    """Compile spec to a grammar without a tokenizer (what a router can do): raises StructuredOutputError naming the
    problem. Slow the first time (imports xgrammar); call it off an event loop."""
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.value, **_json_kwargs())
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(spec.value))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise StructuredOutputError(f"invalid {spec.kind.replace('_', ' ')}: {_clean(e)}") from None


class GrammarBackend:
    """Compiles specs for one tokenizer and builds matchers. Thread-safe: pods compile while admitting requests."""

    def __init__(self, tokenizer_info: Any) -> None:
        xgr = _xgr()
        self.info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        # Its cache is keyed by the spec, so each spec is compiled once per tokenizer (this backend).
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=True)
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> "GrammarBackend":
        """hf_tokenizer: a `tokenizers.Tokenizer`; vocab_size: the model's logits width (may exceed the
        tokenizer's); stop_token_ids: what ends a request (a finished grammar allows only these)."""
        from transformers import PreTrainedTokenizerFast

        xgr = _xgr()
        fast = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        return cls(info)

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar (cached); raises StructuredOutputError for an invalid spec."""
        c = self.compiler
        try:
            with self._lock:
                if spec.kind == "json_schema":
                    return c.compile_json_schema(spec.value, **_json_kwargs())
                if spec.kind == "json_object":
                    return c.compile_json_schema('{"type": "object"}', **_json_kwargs())
                if spec.kind == "regex":
                    return c.compile_regex(spec.value)
                if spec.kind == "choice":
                    return c.compile_grammar(choice_grammar(spec.value))
                return c.compile_grammar(spec.value)
        except Exception as e:
            raise StructuredOutputError(f"invalid {spec.kind.replace('_', ' ')}: {_clean(e)}") from None

    def matcher(self, spec: StructuredSpec) -> "Matcher":
        return Matcher(_xgr().GrammarMatcher(self.compile(spec)))

    def allocate_bitmask(self, rows: int) -> Any:
        return _xgr().allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: Any, bitmask: Any, indices: list[int]) -> None:
        """Set the logits of disallowed tokens to -inf, in place, on the given rows (float32 CPU logits)."""
        _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)


class Matcher:
    """One request's grammar state: accepts the request's output tokens (replayed lazily) and fills its row of the
    batch's bitmask."""

    def __init__(self, m: Any) -> None:
        self._m = m
        self.fed = 0  # output tokens accepted so far
        self.broken = False

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Accept the output tokens this matcher has not seen (the prefill's first token on decode, the previous
        step's token afterwards)."""
        while self.fed < len(output_ids) and not self.broken:
            tok = output_ids[self.fed]
            self.fed += 1
            if self._m.is_terminated():
                continue  # tokens past the end (ignore_eos) are outside the grammar
            if not self._m.accept_token(tok):
                # Only a pod that did not apply this grammar could have produced it: leave the rest unconstrained.
                log.error("output token %d is outside the request's grammar; the rest is unconstrained", tok)
                self.broken = True

    def fill(self, bitmask: Any, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when the row needs no masking."""
        if self.broken or self._m.is_terminated():
            return False  # past the grammar's end (the stop token was accepted) nothing is left to constrain
        return bool(self._m.fill_next_token_bitmask(bitmask, row))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())
