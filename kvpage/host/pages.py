"""Which KV page belongs to whom: the host-side page allocator of the paged cache.

The device cache is one pool of `num_pages` fixed-size pages of `page_size` tokens
(PagedAttention, Kwon et al., SOSP'23). A request holds a list of page ids in
position order — its page table — and grows it one page at a time as it decodes,
so no request preallocates its maximum length. Page 0 is the **null page**: padded
tokens write there and padded page-table entries point there, so it is never
handed out; `num_usable_pages = num_pages - 1`.

Each page carries a reference count. Every owned page has one owner; counting
references rather than flagging ownership leaves room for prefix sharing (one page
in several page tables) without changing the verbs. The verbs come in pairs —
`can_allocate`/`allocate`, `can_grow_to`/`grow_to`, `can_swap_out`/`swap_out`,
`can_swap_in`/`swap_in` — so the scheduler asks before it commits and the commit
never fails halfway.

A host swap pool of `num_host_pages` pages receives the pages of requests
preempted by swapping (vLLM's swap mode); `swap_out`/`swap_in` return the
(source, destination) page pairs that the executor copies.

With `prefix_caching`, full pages whose keys and values are complete carry a name
(`kvpage.host.prefix_cache`): `cached_prefix` finds a new request's longest named
prefix, `allocate(..., prefix_pages=...)` shares those pages (one more reference each),
and `name_pages` names a request's pages as its tokens are computed. A named page whose
last owner lets go stays named on the free list (evictable, least recently freed
first, and a request's pages are freed tail first, as vLLM does, so the end of a prefix
goes before its start); `_take` drops the name of a page it hands out. Free pages
therefore include evictable ones, which is what admission's watermark should see. A
swap-out leaves a request's shared leading pages where they are (it keeps its
references: dropping them would free nothing while others hold them) and copies only
its own pages, so a shared page is never copied to the host, let alone twice.

Pure Python (numpy only for read-outs): never imports jax.
"""

import collections
from collections.abc import Sequence

import numpy as np

from kvpage.host.prefix_cache import PrefixIndex
from kvpage.units import cdiv


class PagePool:
  """Free list, per-request page tables and ref counts for device and host pages."""

  def __init__(self, num_pages: int, page_size: int, num_host_pages: int = 0,
               prefix_caching: bool = False):
    if not isinstance(num_pages, int) or num_pages < 2:
      raise ValueError(f"num_pages must be an integer >= 2 (page 0 is the null page), "
                       f"got {num_pages!r}")
    if not isinstance(page_size, int) or page_size <= 0:
      raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if not isinstance(num_host_pages, int) or num_host_pages < 0:
      raise ValueError(f"num_host_pages must be an integer >= 0, got {num_host_pages!r}")
    self.num_pages = num_pages
    self.page_size = page_size
    self.num_host_pages = num_host_pages
    # FIFO free lists: a freed page goes to the back, so recently used pages are
    # reused last, the order a prefix cache wants for eviction. An ordered dict, so a
    # cached page taken back by a hit leaves from the middle in O(1).
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
        range(1, num_pages))
    self.prefix = PrefixIndex() if prefix_caching else None
    self._num_named: dict[str, int] = {}  # request -> leading pages of its table named
    self._num_evictable = 0  # named pages on the free list
    self._ref_counts = [0] * num_pages
    self._tables: dict[str, list[int]] = {}
    self._host_free = collections.deque(range(num_host_pages))
    self._host_ref_counts = [0] * num_host_pages
    self._host_tables: dict[str, list[int]] = {}

  # Figures.
  @property
  def num_usable_pages(self) -> int:
    """Pages that can be handed out: all but the null page."""
    return self.num_pages - 1

  @property
  def num_free_pages(self) -> int:
    """Device pages on the free list."""
    return len(self._free)

  @property
  def num_used_pages(self) -> int:
    """Device pages some request holds."""
    return self.num_pages - 1 - len(self._free)

  @property
  def usage(self) -> float:
    """Fraction of usable device pages that are owned."""
    return self.num_used_pages / self.num_usable_pages

  @property
  def num_cached_pages(self) -> int:
    """Pages named by the prefix cache, owned or not (0 without prefix caching)."""
    return len(self.prefix) if self.prefix is not None else 0

  @property
  def num_evictable_pages(self) -> int:
    """Named pages on the free list: reusable by a hit, or handed out for new tokens."""
    return self._num_evictable

  @property
  def num_free_host_pages(self) -> int:
    """Host swap pages on the free list."""
    return len(self._host_free)

  @property
  def num_used_host_pages(self) -> int:
    """Host swap pages that a swapped-out request holds."""
    return self.num_host_pages - len(self._host_free)

  @property
  def host_usage(self) -> float:
    """Fraction of host swap pages that are owned (0 without a host pool)."""
    return self.num_used_host_pages / self.num_host_pages if self.num_host_pages else 0.0

  def pages_for(self, num_tokens: int) -> int:
    """Pages that hold `num_tokens` tokens (ceil division)."""
    return cdiv(num_tokens, self.page_size)

  def page_table(self, request_id: str) -> list[int]:
    """The request's live page table (empty if none); callers must not mutate it."""
    return self._tables.get(request_id, [])

  def host_table(self, request_id: str) -> list[int]:
    """The live host page table of a swapped-out request (empty if none)."""
    return self._host_tables.get(request_id, [])

  # Prefix cache.
  def cached_prefix(self, hashes: Sequence[bytes], max_pages: int) -> list[int]:
    """The named pages of the longest run of `hashes` (a sequence's full pages' chain
    hashes, `kvpage.host.prefix_cache`) from the first, at most `max_pages`."""
    if self.prefix is None:
      return []
    return self.prefix.longest_prefix(hashes, max_pages)

  def num_shared(self, pages: Sequence[int]) -> int:
    """Of `pages`, those some request holds: sharing them takes no free page."""
    return sum(1 for page in pages if self._ref_counts[page] > 0)

  def name_pages(self, request_id: str, hashes: Sequence[bytes], num_pages: int) -> None:
    """Names the request's first `num_pages` pages by `hashes` (their keys and values
    are complete, or being written by a launched step); pages named before are skipped."""
    if self.prefix is None:
      return
    table = self._tables.get(request_id, [])
    start = self._num_named.get(request_id, 0)
    stop = min(num_pages, len(hashes), len(table))
    for index in range(start, stop):
      self.prefix.name(table[index], hashes[index])
    self._num_named[request_id] = max(start, stop)

  # Device verbs.
  def can_allocate(self, num_tokens: int, prefix_pages: Sequence[int] = ()) -> bool:
    """Whether a request with no pages could get pages for `num_tokens` tokens now,
    sharing `prefix_pages` (from `cached_prefix`) for its first tokens."""
    fresh = self.pages_for(num_tokens) - len(prefix_pages)
    return fresh + len(prefix_pages) - self.num_shared(prefix_pages) <= len(self._free)

  def allocate(self, request_id: str, num_tokens: int,
               prefix_pages: Sequence[int] = ()) -> list[int]:
    """Gives a request without pages a table holding `num_tokens` tokens, its first
    pages `prefix_pages` (shared: one more reference each, back from the free list if
    none had one), the rest new; returns it."""
    if self._tables.get(request_id):
      raise ValueError(f"request {request_id!r} already holds pages; use grow_to")
    if len(prefix_pages) > self.pages_for(num_tokens):
      raise ValueError(f"{len(prefix_pages)} prefix pages for {num_tokens} tokens")
    if not self.can_allocate(num_tokens, prefix_pages):
      raise ValueError(f"cannot allocate {self.pages_for(num_tokens)} pages for "
                       f"{request_id!r}: only {len(self._free)} free")
    table = self._tables[request_id] = []
    for page in prefix_pages:
      if self._ref_counts[page] == 0:
        del self._free[page]
        self._num_evictable -= 1
      self._ref_counts[page] += 1
      table.append(page)
    self._num_named[request_id] = len(prefix_pages)
    self._take(table, self.pages_for(num_tokens) - len(prefix_pages))
    return table

  def num_missing_pages(self, request_id: str, num_tokens: int) -> int:
    """Pages a request lacks to hold `num_tokens` tokens in total (0 if it has enough)."""
    return max(0, self.pages_for(num_tokens) - len(self._tables.get(request_id, ())))

  def can_grow_to(self, request_id: str, num_tokens: int) -> bool:
    """Whether the request's table can grow to hold `num_tokens` tokens in total."""
    return self.num_missing_pages(request_id, num_tokens) <= len(self._free)

  def grow_to(self, request_id: str, num_tokens: int) -> list[int]:
    """Grows the request's table to hold `num_tokens` tokens in total; returns the new pages.

    `num_tokens` is a total, not an increment: a table that already holds it is left
    as it is. A decode step asks for `num_computed_tokens + 1`, which takes a new page
    only when the token crosses a page boundary; that is why paged memory wastes
    under one page per request (PagedAttention, SOSP'23, section 4.2).
    """
    missing = self.num_missing_pages(request_id, num_tokens)
    if missing > len(self._free):
      raise ValueError(f"cannot grow {request_id!r} by {missing} pages: "
                       f"only {len(self._free)} free")
    table = self._tables.setdefault(request_id, [])
    start = len(table)
    self._take(table, missing)
    return table[start:]

  def free(self, request_id: str) -> int:
    """Drops every device and host page the request holds; returns how many were freed."""
    self._num_named.pop(request_id, None)
    num_freed = self._release(self._tables.pop(request_id, []), self._ref_counts, self._free)
    self._release(self._host_tables.pop(request_id, []), self._host_ref_counts,
                  self._host_free)
    return num_freed

  # Swap verbs: device pages <-> host pool.
  def num_kept_on_swap(self, request_id: str) -> int:
    """Leading pages of the request's table others hold too: a swap-out keeps them."""
    return _num_kept(self._tables.get(request_id, []), self._ref_counts)

  def can_swap_out(self, request_id: str) -> bool:
    """Whether the host pool has a free page for each device page the request would copy."""
    table = self._tables.get(request_id, ())
    return len(table) - self.num_kept_on_swap(request_id) <= len(self._host_free)

  def swap_out(self, request_id: str) -> list[tuple[int, int]]:
    """Moves the request's own pages to host pages (its shared leading pages stay, still
    referenced); returns the (device, host) page copies."""
    if not self.can_swap_out(request_id):
      raise ValueError(f"host pool too small to swap out {request_id!r}")
    table = self._tables.pop(request_id, [])
    kept = _num_kept(table, self._ref_counts)
    if kept:
      self._tables[request_id] = table[:kept]
    self._num_named[request_id] = min(self._num_named.get(request_id, 0), kept)
    device = table[kept:]
    host = self._host_tables[request_id] = []
    for _ in device:
      page = self._host_free.popleft()
      self._host_ref_counts[page] += 1
      host.append(page)
    self._release(device, self._ref_counts, self._free)
    return list(zip(device, host, strict=True))

  def can_swap_in(self, request_id: str, num_extra_pages: int = 0) -> bool:
    """Whether the request's host pages, plus `num_extra_pages`, fit in device memory."""
    needed = len(self._host_tables.get(request_id, ())) + num_extra_pages
    return needed <= len(self._free)

  def swap_in(self, request_id: str) -> list[tuple[int, int]]:
    """Moves the request's host pages back to device pages, after the shared pages it
    kept; returns the (host, device) page copies. Growing the table past them is a
    separate `grow_to`."""
    if not self.can_swap_in(request_id):
      raise ValueError(f"not enough free device pages to swap in {request_id!r}")
    host = self._host_tables.pop(request_id, [])
    device = self._tables.setdefault(request_id, [])
    start = len(device)
    self._take(device, len(host))
    self._release(host, self._host_ref_counts, self._host_free)
    return list(zip(host, device[start:], strict=True))

  # Read-outs for invariant checks and metrics.
  def ref_counts(self) -> np.ndarray:
    """i32[num_pages]: references held on each device page (page 0 always 0)."""
    return np.asarray(self._ref_counts, dtype=np.int32)

  def host_ref_counts(self) -> np.ndarray:
    """i32[num_host_pages]: references held on each host page."""
    return np.asarray(self._host_ref_counts, dtype=np.int32)

  def free_page_ids(self) -> list[int]:
    """The free device pages (evictable named ones included), next to be handed out first."""
    return list(self._free)

  def free_host_page_ids(self) -> list[int]:
    """The free host pages, next to be handed out first."""
    return list(self._host_free)

  def page_tables(self) -> dict[str, list[int]]:
    """A copy of every request's (non-empty) page table."""
    return {rid: list(pages) for rid, pages in self._tables.items() if pages}

  def host_page_tables(self) -> dict[str, list[int]]:
    """A copy of every swapped-out request's host page table."""
    return {rid: list(pages) for rid, pages in self._host_tables.items() if pages}

  # Internals.
  def _take(self, table: list[int], num: int) -> None:
    free, ref_counts, prefix = self._free, self._ref_counts, self.prefix
    for _ in range(num):
      page, _ = free.popitem(last=False)
      if prefix is not None and page in prefix:
        prefix.forget(page)  # evicted: it will hold other tokens
        self._num_evictable -= 1
      ref_counts[page] += 1
      table.append(page)

  def _release(self, pages: list[int], ref_counts: list[int],
               free: "collections.OrderedDict[int, None] | collections.deque[int]") -> int:
    num_freed = 0
    # Tail first, so a prefix cache evicts a prefix's end before its start.
    for page in (reversed(pages) if self.prefix is not None else pages):
      if ref_counts[page] <= 0:
        raise AssertionError(f"page {page} released with ref count {ref_counts[page]}")
      ref_counts[page] -= 1
      if ref_counts[page] == 0:
        if isinstance(free, collections.OrderedDict):
          free[page] = None
          if self.prefix is not None and page in self.prefix:
            self._num_evictable += 1
        else:
          free.append(page)
        num_freed += 1
    return num_freed


def _num_kept(table: list[int], ref_counts: list[int]) -> int:
  """Leading pages of `table` with another owner besides the table's."""
  kept = 0
  for page in table:
    if ref_counts[page] < 2:
      break
    kept += 1
  return kept
