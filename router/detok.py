"""Router-side output assembly: incremental detokenizing and stop strings.

The router detokenizes (decode pods stream token ids) and applies stop strings, so it decides where the text ends.
Decoding the whole output on every token (pdserve.tokenizer.IncrementalDetokenizer) costs O(n^2) over a long
generation; this uses the usual two-offset window instead (vLLM's ``detokenize_incrementally``): decode a few
tokens of context plus the new ones and emit the difference, holding back an incomplete UTF-8 tail. The
concatenated deltas equal ``Tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pdserve.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens already turned into text

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete UTF-8 sequence at the very end comes out as U+FFFD)."""
        return self._delta(final=True) if self._read < len(self.ids) else ""

    def _delta(self, final: bool) -> str:
        prefix_text = (self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
                       if self._read > self._prefix else "")  # the first token has no context to decode
        new_text = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            # Nothing printable yet (a special token skipped, or a multi-byte character not complete).
            if len(new_text) <= len(prefix_text) and not new_text.endswith("\ufffd"):
                self._read = len(self.ids)  # a skipped token: move on, keep the window
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
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
        delta = self.text[self.emitted:end] if end > self.emitted else ""
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
