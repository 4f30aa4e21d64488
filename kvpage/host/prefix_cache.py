"""Automatic prefix caching: a full KV page is named by the tokens that led to it.

Chat traffic repeats itself (a system prompt, a few-shot preamble, a conversation's
earlier turns), and so do the keys and values computed for it. A page's keys and
values depend on its own tokens and on every token before them, so a full page is
named by a chain hash: `hash(parent page's hash, this page's token ids)` (vLLM's
automatic prefix caching; SGLang's RadixAttention shares the idea with a tree). Two
requests whose first `k` pages of tokens agree name the same `k` pages, and the second
can use the first's pages instead of computing them again.

`PrefixIndex` is the map the page pool keeps: hash -> page for every page whose
keys and values are known to be complete, and the way back. A page keeps its name when
its last owner lets go (it sits at the back of the pool's free list, evictable); it
loses it when the pool hands the page out for new tokens. Partial pages are never
named, so a shared page is never written again (no copy-on-write).

`request_hashes` is a request's side: the hashes of its full pages, kept on the
request and extended as its tokens become known (the prompt at once, generated tokens
as they land).

Pure Python: never imports jax.
"""

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from kvpage.request import Request

_ROOT = b"kvpage-prefix-root"


def page_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
  """The name of a full page: 16 bytes of BLAKE2b over its parent's name and its tokens
  (a collision would hand a request another prefix's keys: 2**-64 per pair of pages)."""
  digest = hashlib.blake2b(parent or _ROOT, digest_size=16)
  digest.update(np.asarray(token_ids, np.int64).tobytes())
  return digest.digest()


def request_hashes(request: "Request", num_tokens: int, page_size: int) -> list[bytes]:
  """The chain hashes of `request`'s first `num_tokens // page_size` full pages (its
  known tokens only), extending those kept on the request; returns them all (possibly
  more than asked, from an earlier call)."""
  hashes = request.page_hashes
  for start in range(len(hashes) * page_size, num_tokens - page_size + 1, page_size):
    hashes.append(page_hash(hashes[-1] if hashes else None,
                            request.token_ids(start, start + page_size)))
  return hashes


@dataclasses.dataclass
class PrefixStats:
  """Counters of the cache's use: tokens asked about and found, pages evicted."""

  query_tokens: int = 0  # prompt tokens looked up when a request first got pages
  hit_tokens: int = 0  # of them, tokens whose pages were found cached
  evicted_pages: int = 0  # cached pages handed out for new tokens (their names dropped)

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

  def to_dict(self) -> dict[str, float]:
    return dict(query_tokens=self.query_tokens, hit_tokens=self.hit_tokens,
                hit_rate=self.hit_rate, evicted_pages=self.evicted_pages)


class PrefixIndex:
  """hash <-> page for the pages whose keys and values are complete and named."""

  def __init__(self) -> None:
    self._page_of: dict[bytes, int] = {}
    self._hash_of: dict[int, bytes] = {}
    self.stats = PrefixStats()

  def __len__(self) -> int:
    return len(self._page_of)

  def __contains__(self, page: int) -> bool:
    return page in self._hash_of

  def longest_prefix(self, hashes: Sequence[bytes], max_pages: int) -> list[int]:
    """The cached pages of the longest run of `hashes` from the first, at most `max_pages`."""
    pages = []
    for value in hashes[:max_pages]:
      page = self._page_of.get(value)
      if page is None:
        break
      pages.append(page)
    return pages

  def name(self, page: int, value: bytes) -> bool:
    """Names `page` by `value`, unless either is named already (the same tokens computed
    twice at once keep the first page's name); returns whether it did."""
    if value in self._page_of or page in self._hash_of:
      return False
    self._page_of[value] = page
    self._hash_of[page] = value
    return True

  def forget(self, page: int) -> None:
    """Drops `page`'s name (it is about to hold other tokens)."""
    value = self._hash_of.pop(page, None)
    if value is not None:
      del self._page_of[value]
      self.stats.evicted_pages += 1

  def names(self) -> frozenset[bytes]:
    """Every cached page's name: what a replica reports to a fleet's router."""
    return frozenset(self._page_of)

  def named_pages(self) -> dict[int, bytes]:
    """A copy of page -> hash, for invariant checks."""
    return dict(self._hash_of)
