"""PagePool: the null page stays reserved, verbs come in pairs, nothing leaks."""

import numpy as np
import pytest

from kvpage.host.pages import PagePool
from kvpage.units import NULL_PAGE


def assert_consistent(pool: PagePool) -> None:
  """free + owned = usable pages, each owned page counted once, page 0 never touched."""
  refs = pool.ref_counts()
  owned = [page for pages in pool.page_tables().values() for page in pages]
  free = pool.free_page_ids()
  assert refs[NULL_PAGE] == 0 and NULL_PAGE not in owned and NULL_PAGE not in free
  assert (refs >= 0).all()
  assert len(owned) == len(set(owned)), "a page is owned twice"
  assert sorted(owned + free) == list(range(1, pool.num_pages))
  assert pool.num_free_pages + pool.num_used_pages == pool.num_usable_pages
  assert np.array_equal(refs[owned], np.ones(len(owned))) and (refs[free] == 0).all()
  host_owned = [page for pages in pool.host_page_tables().values() for page in pages]
  assert sorted(host_owned + pool.free_host_page_ids()) == list(range(pool.num_host_pages))
  assert 0 <= pool.usage <= 1 and 0 <= pool.host_usage <= 1


def test_null_page_is_never_handed_out():
  pool = PagePool(num_pages=5, page_size=4)
  assert pool.num_usable_pages == 4
  pages = pool.allocate("a", 16)  # the whole pool
  assert sorted(pages) == [1, 2, 3, 4]
  assert pool.num_free_pages == 0 and pool.usage == 1.0
  assert not pool.can_allocate(1)
  assert_consistent(pool)


@pytest.mark.parametrize("num_tokens,num_pages", [(1, 1), (3, 1), (16, 1), (17, 2), (32, 2),
                                                  (33, 3), (513, 33)])
def test_pages_for_rounds_up_at_page_boundaries(num_tokens, num_pages):
  pool = PagePool(num_pages=64, page_size=16)
  assert pool.pages_for(num_tokens) == num_pages
  assert len(pool.allocate("a", num_tokens)) == num_pages


def test_can_allocate_boundary():
  pool = PagePool(num_pages=11, page_size=16)  # 10 usable pages = 160 tokens
  assert pool.can_allocate(160) and not pool.can_allocate(161)
  with pytest.raises(ValueError, match="cannot allocate 11 pages"):
    pool.allocate("a", 161)
  assert pool.num_free_pages == 10  # a refused allocation takes nothing


def test_grow_to_adds_a_page_only_when_crossing_a_boundary():
  pool = PagePool(num_pages=8, page_size=4)
  table = pool.allocate("a", 3)
  assert len(table) == 1
  assert pool.grow_to("a", 4) == []  # position 3 still fits page 0 of the table
  new = pool.grow_to("a", 5)  # position 4 starts a second page
  assert len(new) == 1 and table == pool.page_table("a") and len(table) == 2
  assert pool.num_missing_pages("a", 13) == 2 and pool.can_grow_to("a", 13)
  assert pool.grow_to("a", 13) == table[2:]
  assert_consistent(pool)


def test_can_grow_to_boundary_and_refusal():
  pool = PagePool(num_pages=4, page_size=4)  # 3 usable pages
  pool.allocate("a", 4)
  pool.allocate("b", 4)
  assert pool.can_grow_to("a", 8) and not pool.can_grow_to("a", 9)
  with pytest.raises(ValueError, match="cannot grow 'a' by 2 pages"):
    pool.grow_to("a", 9)
  assert len(pool.page_table("a")) == 1  # unchanged
  assert_consistent(pool)


def test_free_returns_every_page_and_ref_counts_drop_to_zero():
  pool = PagePool(num_pages=10, page_size=2, num_host_pages=4)
  pool.allocate("a", 5)
  pool.allocate("b", 2)
  assert pool.ref_counts().sum() == 4
  assert pool.free("a") == 3 and pool.free("b") == 1
  assert pool.free("missing") == 0
  assert pool.num_free_pages == 9 and pool.ref_counts().sum() == 0
  assert_consistent(pool)


def test_double_allocate_is_an_error():
  pool = PagePool(num_pages=10, page_size=2)
  pool.allocate("a", 2)
  with pytest.raises(ValueError, match="already holds pages"):
    pool.allocate("a", 2)


def test_swap_round_trip_moves_pages_and_returns_copies():
  pool = PagePool(num_pages=6, page_size=4, num_host_pages=3)
  device = list(pool.allocate("a", 12))
  assert pool.can_swap_out("a")
  copies_out = pool.swap_out("a")
  assert [d for d, _ in copies_out] == device
  host = pool.host_table("a")
  assert [h for _, h in copies_out] == host and len(host) == 3
  assert pool.page_table("a") == [] and pool.num_free_pages == 5 and pool.num_free_host_pages == 0
  assert_consistent(pool)
  pool.allocate("b", 8)  # someone else takes device pages meanwhile
  assert pool.can_swap_in("a") and not pool.can_swap_in("a", num_extra_pages=1)
  copies_in = pool.swap_in("a")
  assert [h for h, _ in copies_in] == host
  assert [d for _, d in copies_in] == pool.page_table("a")
  assert pool.num_free_host_pages == 3 and pool.num_free_pages == 0
  assert_consistent(pool)


def test_swap_out_refused_when_host_pool_is_too_small():
  pool = PagePool(num_pages=6, page_size=4, num_host_pages=2)
  pool.allocate("a", 12)
  assert not pool.can_swap_out("a")
  with pytest.raises(ValueError, match="host pool too small"):
    pool.swap_out("a")
  assert len(pool.page_table("a")) == 3 and pool.num_free_host_pages == 2


def test_free_drops_host_pages_of_a_swapped_request():
  pool = PagePool(num_pages=6, page_size=4, num_host_pages=4)
  pool.allocate("a", 8)
  pool.swap_out("a")
  assert pool.free("a") == 0  # no device pages; the host pages go back to the host pool
  assert pool.num_free_host_pages == 4 and pool.host_usage == 0.0
  assert_consistent(pool)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_pages=1, page_size=16), "num_pages must be an integer >= 2"),
    (dict(num_pages=8, page_size=0), "page_size must be a positive integer"),
    (dict(num_pages=8, page_size=16, num_host_pages=-1), "num_host_pages must be"),
])
def test_bad_sizes_are_rejected(kwargs, message):
  with pytest.raises(ValueError, match=message):
    PagePool(**kwargs)
