"""Router-side output assembly: incremental detokenizing and stop strings.

The router detokenizes (decode pods stream token ids) and applies stop strings, so it decides where the text ends.
Decoding the whole output on every token (pdserve.tokenizer.IncrementalDetokenizer) costs O(n^2) over a long
generation; this uses the `tokenizers` library's DecodeStream instead (a window of a few tokens of context, the
incomplete UTF-8 tail held back). The concatenated deltas equal ``Tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from tokenizers.decoders import DecodeStream

from pdserve.tokenizer import Tokenizer


class Detokenizer:
    """Text deltas for a token stream: the `tokenizers` library's own DecodeStream (a Rust-side window over the last
    tokens that holds back an incomplete UTF-8 tail), ~3-5x cheaper per token than two Python-side decodes."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._hf = tok.hf_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._text = ""  # every delta so far
        self._pending = False  # tokens given since the last delta (an incomplete character, or skipped tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._stream.step(self._hf, token_id)
        if not delta:
            self._pending = True
            return ""
        self._pending = False
        self._text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back (an incomplete UTF-8 sequence at the very end comes out as U+FFFD)."""
        if not self._pending:
            return ""
        self._pending = False
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if not full.startswith(self._text):  # never seen; the text already sent cannot be taken back
            return ""
        delta = full[len(self._text) :]
        self._text = full
        return delta


@dataclass
class Piece:
    """What the client gets for a batch of tokens."""

    token_ids: list[int]
    text: str
    stop: str | None = None  # the stop string that ended the output
    stopped_on_token: bool = False  # an EOS / stop token id ended it


@dataclass
class OutputAssembler:
    """Turns the token stream into client pieces: text deltas, stop strings (router-side), stop-token text rules.

    - A stop token id (or EOS unless ignore_eos) is kept in token_ids but not in the text.
    - A stop string ends the output at the token that completes it; the text stops before the match.
    - Stop strings and stop tokens only count once ``min_tokens`` tokens were generated.
    - While stop strings are set, the last ``max(len(stop)) - 1`` characters are held back so streamed text is never
      taken back.
    """

    tok: Tokenizer
    stop: list[str] = field(default_factory=list)
    stop_token_ids: Iterable[int] = ()
    eos_token_ids: Iterable[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.detok = Detokenizer(self.tok, self.skip_special_tokens)
        self._stop_ids = set(self.stop_token_ids) | (set() if self.ignore_eos else set(self.eos_token_ids))
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far (before stop-string truncation)
        self.emitted = 0  # characters of text already sent
        self.num_tokens = 0
        self.finished = False

    def add(self, token_ids: Iterable[int], final: bool = False) -> Piece:
        """Feed tokens; ``final`` when the stream ends after them (flushes held-back text). After a stop, further
        tokens are dropped."""
        out_ids: list[int] = []
        stop: str | None = None
        on_token = False
        visible_end: int | None = None
        for t in token_ids:
            if self.finished:
                break
            out_ids.append(t)
            self.num_tokens += 1
            may_stop = self.num_tokens >= self.min_tokens
            if t in self._stop_ids and may_stop:
                on_token = True
                self.finished = True
                break
            before = len(self.text)
            self.text += self.detok.add(t)
            if self.stop and may_stop:
                stop, at = self._find_stop(before)
                if stop is not None:
                    visible_end = at
                    self.finished = True
                    break
        if self.finished or final:
            if not on_token and stop is None:
                self.text += self.detok.flush()
            end = len(self.text) if visible_end is None else visible_end
        else:
            end = max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return Piece(out_ids, delta, stop, on_token)

    def _find_stop(self, before: int) -> tuple[str | None, int]:
        start = max(0, before - self._hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return (None, -1) if best is None else (best[1], best[0])
