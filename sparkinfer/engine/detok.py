"""Incremental detokenization and stop strings: a request's text as its tokens come.

    d = TextStream(tokenizer, prompt_ids, stop=("\\n\\n",))
    delta, stopped = d.push([1234, 567])   # new text to show; True once a stop string matched

Decoding a whole output at every token costs O(n^2); this decodes a short window:
the text of ids[prefix:] minus the text of ids[prefix:read] (the window re-decodes
a few tokens before the new ones, so byte-level and SentencePiece tokenizers join
words and multi-byte characters correctly). Text that ends in an incomplete UTF-8
sequence ("\\ufffd") is held back until the next token completes it. With stop
strings, the longest end of the text that could begin a stop string is held back
too, and a match ends the text before the stop string.
"""

from __future__ import annotations

__all__ = ["TextStream"]

# Prompt tokens decoded before the first new one, so its leading space or joined
# characters come out as they would in the middle of the text.
_CONTEXT = 5
# Tokens whose text `singles` keeps at most (a vocabulary: Qwen3's has 151,936 ids).
_SINGLES = 1 << 18


class TextStream:
    """tokenizer: anything with decode(ids) -> str; prompt: the request's prompt ids;
    stop: stop strings; singles: a dict {token id: its text alone} shared by the streams
    of one tokenizer (decode is a pure function of the ids), or None."""

    def __init__(self, tokenizer, prompt: list[int], stop: tuple[str, ...] = (), singles: dict | None = None):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.ids = list(prompt[-_CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""      # the output's text so far (not yet cut at a stop), kept with stop strings only
        self.shown = 0      # characters of `text` handed out
        self.stopped = False
        self.singles = {} if singles is None else singles

    def push(self, ids, final: bool = False) -> tuple[str, bool]:
        """Add new token ids; return (text to show now, whether a stop string matched).
        final: the request ends here, so nothing is held back."""
        if self.stopped:
            return "", True
        self.ids += ids
        # Decoding one token at a time, the window before the new ones is one token: its
        # text comes from `singles` (one decode a token a step, not two).
        if self.read - self.prefix == 1:
            t = self.ids[self.prefix]
            before = self.singles.get(t)
            if before is None:
                if len(self.singles) >= _SINGLES:
                    self.singles.clear()
                before = self.singles[t] = self.tok.decode([t])
        else:
            before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        new = ""
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            new = now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        if not self.stop:  # every new character is shown at once
            return new, False
        self.text += new
        end = len(self.text)
        hit = self._match()
        if hit is not None:
            self.stopped = True
            end = hit
        elif not final:
            end -= self._held()
        delta = self.text[self.shown:max(end, self.shown)]
        self.shown = max(end, self.shown)
        return delta, self.stopped

    def _match(self) -> int | None:
        """Where the earliest stop string starts in the text (searching only where a new
        match can be: from the last shown character back by the longest stop)."""
        lo = max(0, self.shown - max(len(s) for s in self.stop) + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Characters at the end of the text that are a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
