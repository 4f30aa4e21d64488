"""The one bridge from host to device: scheduled sequences in, a padded `StepBatch` out.

The scheduler speaks in Python objects (`ScheduledSequence`: token ids, a start
position, a page list); the jitted step speaks in fixed-shape arrays. `build` turns
one into the other, flattening the ragged batch to `[num_tokens]` and padding every
dimension up a fixed ladder of buckets, so that steady-state serving reuses a handful
of compiled programs instead of recompiling for every new batch size.

Padding is inert by construction: padding tokens write their keys and values into
the null page (page 0), padding sequences have no tokens, context length 0 and a
block table of null pages, and padding rows of `logits_indices` point at token 0,
whose sampled id the host ignores.

Host side: numpy only. `StepBatch` is a NamedTuple, which jax treats as a pytree.
"""

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class StepBatch(NamedTuple):
  """The arrays one step needs, padded to buckets. Shapes: T tokens, S seqs, M pages."""

  token_ids: np.ndarray  # i32[T]
  positions: np.ndarray  # i32[T], position of each token in its sequence
  slot_mapping: np.ndarray  # i32[T], page * page_size + offset; padding -> null page
  query_start_loc: np.ndarray  # i32[S + 1], cumulative new-token counts
  context_lens: np.ndarray  # i32[S], KV length including this step's tokens
  block_tables: np.ndarray  # i32[S, M], padded with the null page
  logits_indices: np.ndarray  # i32[S], each sequence's last token row
  temperature: np.ndarray  # f32[S], 0 = greedy
  top_k: np.ndarray  # i32[S], 0 = off
  top_p: np.ndarray  # f32[S], 1 = off
  seeds: np.ndarray  # u32[S], per-request seed
  sample_index: np.ndarray  # i32[S], tokens generated so far (folded into the key)


@dataclasses.dataclass(frozen=True)
class BatchInfo:
  """Host-side facts about a built batch that the device never needs."""

  request_ids: list[str]  # row s of the batch belongs to request_ids[s]
  samples: list[bool]  # whether row s produces a token this step
  num_tokens: int  # real (unpadded) tokens
  num_seqs: int  # real sequences
  all_greedy: bool  # every sampling row has temperature 0: skip the sampler

  @property
  def padded_shape(self) -> tuple[int, int]:
    return self.num_tokens, self.num_seqs


def bucket(value: int, ladder: Sequence[int], what: str) -> int:
  """The smallest rung of `ladder` that holds `value`."""
  for rung in ladder:
    if value <= rung:
      return rung
  raise ValueError(f"{what}={value} exceeds the largest bucket {ladder[-1]}; "
                   "lower the scheduler's token/sequence budget")


def page_bucket(num_pages: int) -> int:
  """Pages per block-table row, rounded up to a power of two (at least 1)."""
  return 1 << max(0, (max(num_pages, 1) - 1).bit_length())


def request_seed(request: Any) -> int:
  """The request's sampling seed, or a stable one derived from its id (reproducible runs)."""
  seed = request.sampling.seed
  return (zlib.crc32(request.request_id.encode()) if seed is None else seed) & 0xFFFFFFFF


def build(scheduled: Sequence[Any], *, page_size: int,
          token_buckets: Sequence[int] = TOKEN_BUCKETS,
          seq_buckets: Sequence[int] = SEQ_BUCKETS) -> tuple[StepBatch, BatchInfo]:
  """Flattens scheduled sequences (`kvpage.scheduler_output.ScheduledSequence`) into a batch."""
  if not scheduled:
    raise ValueError("cannot build a batch from no sequences")
  num_tokens = sum(len(seq.token_ids) for seq in scheduled)
  num_seqs = len(scheduled)
  max_pages = max(len(seq.page_ids) for seq in scheduled)
  padded_tokens = bucket(num_tokens, token_buckets, "num_tokens")
  padded_seqs = bucket(num_seqs, seq_buckets, "num_seqs")
  batch = example_batch(padded_tokens, padded_seqs, page_bucket(max_pages))
  token_ids, positions, slots = [], [], []
  start = 0
  for row, seq in enumerate(scheduled):
    n, first = len(seq.token_ids), seq.start_position
    if n == 0 or (first + n) > len(seq.page_ids) * page_size:
      raise ValueError(f"request {seq.request_id}: {n} tokens from position {first} do not "
                       f"fit its {len(seq.page_ids)} pages of {page_size}")
    pages = np.asarray(seq.page_ids, np.int32)
    pos = np.arange(first, first + n, dtype=np.int32)
    token_ids.append(seq.token_ids)
    positions.append(pos)
    slots.append(pages[pos // page_size] * page_size + pos % page_size)
    batch.block_tables[row, :len(pages)] = pages
    batch.context_lens[row] = first + n
    start += n
    batch.query_start_loc[row + 1] = start
    batch.logits_indices[row] = start - 1
    sampling = seq.request.sampling
    batch.temperature[row], batch.top_k[row] = sampling.temperature, sampling.top_k
    batch.top_p[row] = sampling.top_p
    batch.seeds[row] = request_seed(seq.request)
    batch.sample_index[row] = len(seq.request.output_ids)
  batch.token_ids[:num_tokens] = np.concatenate(token_ids)
  batch.positions[:num_tokens] = np.concatenate(positions)
  batch.slot_mapping[:num_tokens] = np.concatenate(slots)
  batch.query_start_loc[num_seqs + 1:] = num_tokens
  info = BatchInfo(
      request_ids=[seq.request_id for seq in scheduled],
      samples=[seq.samples for seq in scheduled], num_tokens=num_tokens, num_seqs=num_seqs,
      all_greedy=all(seq.request.sampling.temperature == 0 for seq in scheduled if seq.samples))
  return batch, info


def example_batch(num_tokens: int, num_seqs: int, max_pages_per_seq: int) -> StepBatch:
  """An all-padding batch of the given (bucketed) shape: every token writes the null page."""
  i32 = np.int32
  return StepBatch(
      token_ids=np.zeros(num_tokens, i32), positions=np.zeros(num_tokens, i32),
      slot_mapping=np.zeros(num_tokens, i32), query_start_loc=np.zeros(num_seqs + 1, i32),
      context_lens=np.zeros(num_seqs, i32),
      block_tables=np.zeros((num_seqs, max_pages_per_seq), i32),
      logits_indices=np.zeros(num_seqs, i32), temperature=np.zeros(num_seqs, np.float32),
      top_k=np.zeros(num_seqs, i32), top_p=np.ones(num_seqs, np.float32),
      seeds=np.zeros(num_seqs, np.uint32), sample_index=np.zeros(num_seqs, i32))
