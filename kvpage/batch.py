"""The one bridge from host to device: scheduled sequences in, a padded `StepBatch` out.

The scheduler speaks in Python objects (`ScheduledSequence`: token ids, a start
position, a page list); the jitted step speaks in fixed-shape arrays. `build` turns
one into the other, flattening the ragged batch to `[num_tokens]` and padding every
dimension up a fixed ladder of buckets, so that steady-state serving reuses a handful
of compiled programs instead of recompiling for every new batch size.

Under async scheduling a decode's input token may still be in flight (the previous
step sampled it on the device; `kvpage.request.PLACEHOLDER` on the host): `build`
encodes it as `-(row + 1)`, the row where the previous step sampled it, and the
jitted step reads it from that step's output without a round trip through the host.

Padding is inert by construction: padding tokens write their keys and values into
the null page (page 0), padding sequences have no tokens, context length 0 and a
page table of null pages, and padding rows of `logits_indices` point at token 0,
whose sampled id the host ignores.

Host side: numpy only. `StepBatch` is a NamedTuple, which jax treats as a pytree.
"""

import dataclasses
import itertools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvpage.request import PLACEHOLDER
from kvpage.units import cdiv

MAX_BANNED = 20  # stop token ids a row can hold back: the client's 16 and EOS ids
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class StepBatch(NamedTuple):
  """The arrays one step needs, padded to buckets. Shapes: T tokens, S seqs, M pages."""

  token_ids: np.ndarray  # i32[T]; -(r + 1): the token the previous step sampled in row r
  positions: np.ndarray  # i32[T], position of each token in its sequence
  slot_mapping: np.ndarray  # i32[T], page * page_size + offset; padding -> null page
  query_start_loc: np.ndarray  # i32[S + 1], cumulative new-token counts
  context_lens: np.ndarray  # i32[S], KV length including this step's tokens
  page_tables: np.ndarray  # i32[S, M], padded with the null page
  logits_indices: np.ndarray  # i32[S], each sequence's last token row
  temperature: np.ndarray  # f32[S], 0 = greedy
  top_k: np.ndarray  # i32[S], 0 = off
  top_p: np.ndarray  # f32[S], 1 = off
  seeds: np.ndarray  # u32[S], per-request seed
  sample_index: np.ndarray  # i32[S], tokens generated so far (folded into the key)
  num_steps: np.ndarray  # i32[S], decode iterations of each row (multi-step); padding 0
  # i32[S, MAX_BANNED]: token ids a row may not sample (its stop tokens, while it has
  # fewer than `min_tokens`); -1 pads.
  banned: np.ndarray

  # Not a field: a class-level fact. jit keys its cache on the pytree's type, so the
  # subclass below is a *static* flag the model can branch on at trace time.
  decode_only = False


class DecodeStepBatch(StepBatch):
  """A `StepBatch` whose every sequence brings exactly one new token, token `s` being
  sequence `s`'s: models may take a decode-only attention path
  (`kvpage.device.backends.xla.attention.paged_decode_attention`). `build` returns it when that
  holds."""

  __slots__ = ()
  decode_only = True


@dataclasses.dataclass(frozen=True)
class Buckets:
  """Which padded shapes a server compiles: the fewer, the fewer compilations.

  By default every dimension follows its ladder. A server that knows its limits pins
  two of them so that the set of programs is small and known ahead of time (and can
  be compiled at start-up, `JaxExecutor.warmup`):
    * `max_pages_per_seq`: every page table is this wide (the model's context in
      pages). Attention loops only as far as the longest context, so width is cheap.
    * `mixed_num_seqs`: batches that are not decode-only are padded to this many
      sequences (the scheduler's `max_num_seqs`), leaving one program per token bucket.
  Decode-only batches keep `num_tokens == num_seqs` on the sequence ladder.
  """

  token_buckets: tuple[int, ...] = TOKEN_BUCKETS
  seq_buckets: tuple[int, ...] = SEQ_BUCKETS
  max_pages_per_seq: int | None = None
  mixed_num_seqs: int | None = None

  @classmethod
  def for_server(cls, *, max_model_len: int, page_size: int, max_num_seqs: int) -> "Buckets":
    """Pinned table width and mixed batch size for a server with these limits."""
    return cls(max_pages_per_seq=cdiv(max_model_len, page_size),
               mixed_num_seqs=bucket(max_num_seqs, SEQ_BUCKETS, "max_num_seqs"))

  def decode_shape(self, num_seqs: int) -> tuple[int, int]:
    """`(tokens, seqs)` of a decode-only batch of `num_seqs` sequences."""
    seqs = bucket(num_seqs, self.seq_buckets, "num_seqs")
    return bucket(seqs, self.token_buckets, "num_tokens"), seqs

  def mixed_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """`(tokens, seqs)` of a batch with at least one prefill chunk."""
    seqs = self.mixed_num_seqs or bucket(num_seqs, self.seq_buckets, "num_seqs")
    if num_seqs > seqs:
      raise ValueError(f"num_seqs={num_seqs} exceeds the pinned mixed batch size {seqs}")
    return bucket(num_tokens, self.token_buckets, "num_tokens"), seqs

  def padded_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """`(tokens, seqs)` a batch of these sizes is padded to: decode-only when every
    sequence brings one token, else mixed."""
    return (self.decode_shape(num_seqs) if num_tokens == num_seqs
            else self.mixed_shape(num_tokens, num_seqs))

  def table_width(self, num_pages: int) -> int:
    if self.max_pages_per_seq is None:
      return table_bucket(num_pages)
    if num_pages > self.max_pages_per_seq:
      raise ValueError(f"a sequence holds {num_pages} pages, more than the pinned page-table "
                       f"width {self.max_pages_per_seq}")
    return self.max_pages_per_seq

  def warmup_shapes(self, max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[int, int, bool]]:
    """Every `(tokens, seqs, decode_only)` a scheduler with these limits can produce."""
    shapes = {(*self.decode_shape(n), True) for n in range(1, max_num_seqs + 1)}
    for rung in self.token_buckets:
      shapes.add((*self.mixed_shape(rung, 1), False))
      if rung >= max_num_batched_tokens:
        break
    return sorted(shapes)


DEFAULT_BUCKETS = Buckets()


@dataclasses.dataclass(frozen=True)
class BatchInfo:
  """Host-side facts about a built batch that the device never needs."""

  request_ids: list[str]  # row s of the batch belongs to request_ids[s]
  samples: list[bool]  # whether row s produces a token this step
  num_tokens: int  # real (unpadded) tokens
  num_seqs: int  # real sequences
  all_greedy: bool  # every sampling row has temperature 0: skip the sampler
  num_steps: list[int]  # tokens row s samples: its decode iterations (multi-step), else 1


def bucket(value: int, ladder: Sequence[int], what: str) -> int:
  """The smallest rung of `ladder` that holds `value`."""
  for rung in ladder:
    if value <= rung:
      return rung
  raise ValueError(f"{what}={value} exceeds the largest bucket {ladder[-1]}; "
                   "lower the scheduler's token/sequence budget")


def page_bucket(num_pages: int) -> int:
  """Pages per page-table row, rounded up to a power of two (at least 1)."""
  return 1 << max(0, (max(num_pages, 1) - 1).bit_length())


def table_bucket(num_pages: int) -> int:
  """Page-table width: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... that holds `num_pages`.

  Attention gathers every entry of the table, padding included, so a power-of-two
  ladder reads up to 2x the pages a decode needs; half-steps cap the waste at 1.5x for
  ~1.7x as many compiled widths (each compiled once, then reused).
  """
  width = page_bucket(num_pages)
  return width * 3 // 4 if width >= 4 and num_pages <= width * 3 // 4 else width


def request_seed(request: Any) -> int:
  """The request's sampling seed, or a stable one derived from its id (reproducible runs)."""
  seed = request.sampling.seed
  return (zlib.crc32(request.request_id.encode()) if seed is None else seed) & 0xFFFFFFFF


def build(scheduled: Sequence[Any], *, page_size: int, buckets: Buckets | None = None,
          feed_rows: Mapping[str, int] | None = None) -> tuple[StepBatch, BatchInfo]:
  """Flattens scheduled sequences (`kvpage.interface.ScheduledSequence`) into a batch.

  `feed_rows` maps each request that sampled in the previous step to its row there;
  a placeholder token (one still in flight) must belong to such a request.

  Runs on the host every step, so it is written as a few whole-batch numpy operations
  over flat lists rather than per-row numpy calls (whose fixed cost, times 32+ rows,
  was a visible share of a decode step). Returns a `DecodeStepBatch` when every
  sequence brings exactly one token.
  """
  if not scheduled:
    raise ValueError("cannot build a batch from no sequences")
  query_lens = [len(seq.token_ids) for seq in scheduled]
  starts = [seq.start_position for seq in scheduled]
  table_lens = [len(seq.page_ids) for seq in scheduled]
  for seq, n, first, num_pages in zip(scheduled, query_lens, starts, table_lens):
    extra = seq.num_steps - 1  # positions the later iterations of a multi-step decode add
    if n == 0 or first + n + extra > num_pages * page_size or (extra and n != 1):
      raise ValueError(f"request {seq.request_id}: {n} tokens from position {first} "
                       f"({seq.num_steps} iterations) do not fit its {num_pages} pages of "
                       f"{page_size}, or are not one decode token")
  buckets = buckets or DEFAULT_BUCKETS
  num_tokens, num_seqs = sum(query_lens), len(scheduled)
  decode_only = num_tokens == num_seqs  # every sequence brings one token (none brings zero)
  padded_tokens, padded_seqs = buckets.padded_shape(num_tokens, num_seqs)
  batch = example_batch(padded_tokens, padded_seqs, buckets.table_width(max(table_lens)),
                        decode_only=decode_only)
  _fill_tables(batch, scheduled, table_lens)
  _fill_tokens(batch, scheduled, query_lens, starts, page_size, feed_rows or {})
  _fill_sampling(batch, scheduled)
  info = BatchInfo(
      request_ids=[seq.request_id for seq in scheduled],
      samples=[seq.samples for seq in scheduled], num_tokens=num_tokens, num_seqs=num_seqs,
      all_greedy=all(seq.request.sampling.temperature == 0 for seq in scheduled if seq.samples),
      num_steps=[seq.num_steps for seq in scheduled])
  return batch, info


def _fill_tables(batch: StepBatch, scheduled: Sequence[Any], table_lens: list[int]) -> None:
  """Page tables: every sequence's page list, left-aligned, null pages after."""
  flat = np.fromiter(itertools.chain.from_iterable(seq.page_ids for seq in scheduled),
                     np.int32, sum(table_lens))
  rows = np.repeat(np.arange(len(table_lens)), table_lens)
  row_starts = np.cumsum(table_lens) - table_lens
  batch.page_tables[rows, np.arange(len(flat)) - row_starts[rows]] = flat


def _fill_tokens(batch: StepBatch, scheduled: Sequence[Any], query_lens: list[int],
                 starts: list[int], page_size: int, feed_rows: Mapping[str, int]) -> None:
  """Token ids, positions, slots (through the tables filled above) and query offsets."""
  num_tokens, num_seqs = sum(query_lens), len(query_lens)
  token_ids = batch.token_ids[:num_tokens]
  token_ids[:] = np.fromiter(
      itertools.chain.from_iterable(seq.token_ids for seq in scheduled), np.int32, num_tokens)
  ends = np.cumsum(query_lens, dtype=np.int32)
  token_rows = np.repeat(np.arange(num_seqs), query_lens)
  for index in np.flatnonzero(token_ids == PLACEHOLDER).tolist():
    request_id = scheduled[token_rows[index]].request_id
    if request_id not in feed_rows:
      raise ValueError(f"request {request_id}: a token in flight that the previous step did "
                       "not sample")
    token_ids[index] = -1 - feed_rows[request_id]
  positions = (np.arange(num_tokens, dtype=np.int32) - (ends - query_lens)[token_rows]
               + np.asarray(starts, np.int32)[token_rows])
  batch.positions[:num_tokens] = positions
  pages = batch.page_tables[token_rows, positions // page_size]
  batch.slot_mapping[:num_tokens] = pages * page_size + positions % page_size
  batch.context_lens[:num_seqs] = np.asarray(starts, np.int32) + query_lens
  batch.query_start_loc[1:num_seqs + 1] = ends
  batch.query_start_loc[num_seqs + 1:] = num_tokens
  batch.logits_indices[:num_seqs] = ends - 1


def _fill_sampling(batch: StepBatch, scheduled: Sequence[Any]) -> None:
  """Per-row sampling parameters, seeds, the index folded into each row's key, iterations,
  and the stop tokens a row below its `min_tokens` may not sample."""
  num_seqs = len(scheduled)
  params = [seq.request.sampling for seq in scheduled]
  batch.temperature[:num_seqs] = [p.temperature for p in params]
  batch.top_k[:num_seqs] = [p.top_k for p in params]
  batch.top_p[:num_seqs] = [p.top_p for p in params]
  batch.seeds[:num_seqs] = [request_seed(seq.request) for seq in scheduled]
  batch.sample_index[:num_seqs] = [seq.sample_index for seq in scheduled]
  batch.num_steps[:num_seqs] = [seq.num_steps for seq in scheduled]
  if not any(p.min_tokens for p in params):  # (the common case: no per-row loop)
    return
  for row, seq in enumerate(scheduled):  # min_tokens: no stop token before that many
    sampling = seq.request.sampling
    if seq.samples and seq.sample_index < sampling.min_tokens and not sampling.ignore_eos:
      stops = sampling.stop_token_ids[:MAX_BANNED]
      batch.banned[row, :len(stops)] = stops


def prompt_targets(scheduled: Sequence[Any], num_rows: int
                   ) -> tuple[np.ndarray, tuple[tuple[str, int, int, int, int], ...]]:
  """For the sequences whose request asks for prompt log-probabilities: each token
  row's target, the prompt token after it (-1 past the prompt's end and for every other
  row), and the rows' owners, `(request id, first row, first position, rows, top
  count)`. Rows follow `scheduled`, each sequence's tokens in a run, as `build` lays
  them out."""
  targets = np.full(num_rows, -1, np.int32)
  owners, row = [], 0
  for seq in scheduled:
    top = seq.request.sampling.prompt_logprobs
    prompt = seq.request.prompt_ids
    if top is not None and seq.is_prefill and seq.start_position < len(prompt) - 1:
      stop = min(seq.start_position + seq.num_tokens, len(prompt) - 1)
      count = stop - seq.start_position
      targets[row:row + count] = prompt[seq.start_position + 1:stop + 1]
      owners.append((seq.request_id, row, seq.start_position, count, top))
    row += seq.num_tokens
  return targets, tuple(owners)


_FIELD_DTYPES = {"temperature": np.float32, "top_p": np.float32, "seeds": np.uint32}  # else i32


class BatchLayout(NamedTuple):
  """What a packed batch holds: its type (decode-only or not) and each field's shape.

  Static (hashable), so the jitted step unpacks a packed batch with shapes it knows at
  trace time; one layout per bucketed shape, like the programs themselves.
  """

  batch_type: type
  shapes: tuple[tuple[int, ...], ...]


def pack(batch: StepBatch) -> tuple[np.ndarray, BatchLayout]:
  """The batch as one `i32` buffer plus its layout: one host-to-device copy per step.

  Copying a pytree of thirteen small arrays costs a transfer per leaf (about 0.23 ms
  on a 2-core CPU, a fifth of a batch-1 decode step); one buffer costs one.
  The 4-byte floats and seeds travel as their bits and are viewed back on the device.
  """
  packed = np.concatenate([np.ascontiguousarray(field).reshape(-1).view(np.int32)
                           for field in batch])
  return packed, BatchLayout(type(batch), tuple(field.shape for field in batch))


def field_dtype(name: str) -> type:
  """The numpy dtype of a `StepBatch` field."""
  return _FIELD_DTYPES.get(name, np.int32)


def example_batch(num_tokens: int, num_seqs: int, max_pages_per_seq: int, *,
                  decode_only: bool = False) -> StepBatch:
  """An all-padding batch of the given (bucketed) shape: every token writes the null page.

  The fields are consecutive views of one zeroed buffer (one allocation per step,
  not twelve; the 4-byte floats and seeds are views of it too).
  """
  t, s, m = num_tokens, num_seqs, max_pages_per_seq
  shapes = ((t,), (t,), (t,), (s + 1,), (s,), (s, m), (s,), (s,), (s,), (s,), (s,), (s,), (s,),
            (s, MAX_BANNED))
  buffer = np.zeros(sum(math.prod(shape) for shape in shapes), np.int32)
  fields, offset = [], 0
  for name, shape in zip(StepBatch._fields, shapes, strict=True):
    size = math.prod(shape)
    fields.append(buffer[offset:offset + size].view(field_dtype(name))
                  .reshape(shape))
    offset += size
  batch = (DecodeStepBatch if decode_only else StepBatch)(*fields)
  batch.top_p[:] = 1.0
  batch.banned[:] = -1
  return batch
