"""Tokens to text as they arrive, and stop strings matched on that text.

**Incremental detokenization.** A byte-level BPE token may hold half of a UTF-8
character, and a SentencePiece token's leading space depends on the token before it,
so decoding each token alone garbles text. `IncrementalDetokenizer` keeps two offsets
into the token ids (the scheme of vLLM's and TGI's detokenizers): it decodes a short
window that ends at the last text it emitted and the same window extended by the new
tokens, and emits the difference — unless the decoded text ends in U+FFFD, the
replacement character of an incomplete UTF-8 sequence, in which case it waits for the
next token. The deltas therefore concatenate to the decoding of all tokens at once,
and a multi-byte character is never split. `flush` emits what is still held when the
request ends (an incomplete sequence decodes to U+FFFD then, exactly as it does in the
whole decoding).

**Stop strings.** `StopStrings` finds the first stop string in the text, across token
boundaries, and holds back any tail of the text that could still become one, so a
client never sees part of a stop string; the matched string is not emitted (OpenAI's
rule).
"""

from collections.abc import Sequence
from typing import Any, Protocol

# Prompt tokens kept as context, so the first output token decodes as it would after
# them (a leading space, a multi-byte character begun in the prompt).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
  """What the gateway asks of a tokenizer (a Hugging Face one satisfies it)."""

  def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
  """Text deltas from token ids, one batch of new tokens at a time."""

  def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *,
               skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    self._prefix_offset = 0  # the window decoded for context starts here...
    self._read_offset = len(self._ids)  # ...and ends where the emitted text ends

  def _decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

  def push(self, token_ids: Sequence[int]) -> str:
    """Adds generated tokens; returns the text they complete ('' while a character is
    incomplete)."""
    self._ids.extend(token_ids)
    return self._advance(final=False)

  def flush(self) -> str:
    """The text still held back; call once, when the request ends."""
    return self._advance(final=True)

  def _advance(self, *, final: bool) -> str:
    if self._read_offset == len(self._ids):
      return ""
    prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
    text = self._decode(self._ids[self._prefix_offset:])
    if len(text) <= len(prefix) or (text.endswith(REPLACEMENT) and not final):
      return ""
    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
    return text[len(prefix):]


class StopStrings:
  """The text before the first stop string (or through it, with `include`), streamed;
  `stopped` once one matched, `matched` the one that did."""

  def __init__(self, stops: Sequence[str], *, include: bool = False):
    self.stops = tuple(stop for stop in stops if stop)
    self.include = include
    self.stopped = False
    self.matched: str | None = None
    self._held = ""  # a tail that may be the start of a stop string

  def push(self, text: str, armed: bool = True) -> str:
    """Adds text; returns what can be emitted. After a match, returns the text before
    it (through it, with `include`), sets `stopped`, and ignores anything later. Text
    pushed while not `armed` (the request has fewer than its `min_tokens`) is not
    searched."""
    if self.stopped or not self.stops:
      return "" if self.stopped else text
    if not armed:
      held, self._held = self._held, ""
      return held + text
    text = self._held + text
    found = [(index, stop) for index, stop in ((text.find(stop), stop) for stop in self.stops)
             if index >= 0]
    if found:
      index, stop = min(found)
      self.stopped, self.matched, self._held = True, stop, ""
      return text[:index + len(stop)] if self.include else text[:index]
    keep = max((k for stop in self.stops for k in range(1, len(stop))
                if text.endswith(stop[:k])), default=0)
    self._held = text[len(text) - keep:] if keep else ""
    return text[:len(text) - keep]

  def flush(self) -> str:
    """The held-back tail: no stop string completed it before the request ended."""
    held, self._held = ("" if self.stopped else self._held), ""
    return held
