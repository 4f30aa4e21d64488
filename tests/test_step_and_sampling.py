"""The jitted step never recompiles in steady state; sampling is pure and reproducible."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config

from configs import scheduler as scheduler_lib
from kvpage import batch as batch_lib
from kvpage import build
from kvpage.device import sampling
from kvpage.device import step as step_lib
from kvpage.interface import ScheduledSequence
from kvpage.request import Request, SamplingParams
from kvpage.sim import replay, workload
from models import llama

MODEL = tiny_config.get_config().model


@pytest.fixture(scope="module")
def params():
  return llama.random_init(MODEL, seed=0)


def tiny_engine(params, **kwargs):
  return build.jax_engine(llama, MODEL, params, scheduler_lib.get_scheduler_config(),
                          num_pages=128, page_size=16, **kwargs)


_BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _BACKEND_COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def test_steady_state_decoding_never_recompiles(params):
  engine = tiny_engine(params)
  prompts = [[1 + i, 2, 3, 4 + i] for i in range(5)]
  engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
  compiles, backend_compiles = engine.executor.num_compiles, len(_BACKEND_COMPILES)
  # A second batch whose sizes fall in the same buckets (<= 8 tokens/seqs for decode,
  # prompts within one page): no new trace, and no XLA compilation either (jit also
  # keys on what the counter cannot see, e.g. whether an input is committed).
  engine.generate([[9, 8, 7, 6]] * 5, SamplingParams(max_tokens=12, ignore_eos=True))
  assert engine.executor.num_compiles == compiles
  assert len(_BACKEND_COMPILES) == backend_compiles
  # A different bucket does compile (the counter can move).
  engine.generate([list(range(1, 40))], SamplingParams(max_tokens=2, ignore_eos=True))
  assert engine.executor.num_compiles > compiles


def test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy(params):
  prompts = [[5, 6, 7], [8, 9, 10, 11]]
  hot = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=123,
                       ignore_eos=True)
  first = [r.output_ids for r in tiny_engine(params).generate(prompts, hot)]
  again = [r.output_ids for r in tiny_engine(params).generate(prompts, hot)]
  assert first == again
  other = SamplingParams(**{**vars(hot), "seed": 124})
  assert [r.output_ids for r in tiny_engine(params).generate(prompts, other)] != first
  greedy = tiny_engine(params).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
  cold = tiny_engine(params).generate(prompts, SamplingParams(
      max_tokens=10, temperature=0.0, top_k=5, seed=9, ignore_eos=True))
  assert [r.output_ids for r in greedy] == [r.output_ids for r in cold]


def sampling_rows(num_rows, **fields):
  defaults = dict(temperature=1.0, top_k=0, top_p=1.0, seeds=0, sample_index=0)
  defaults.update(fields)
  dtypes = dict(temperature=jnp.float32, top_p=jnp.float32, top_k=jnp.int32,
                seeds=jnp.uint32, sample_index=jnp.int32)
  return types.SimpleNamespace(banned=jnp.full((num_rows, 1), -1, jnp.int32), **{
      key: jnp.broadcast_to(jnp.asarray(value, dtypes[key]), (num_rows,))
      for key, value in defaults.items()})


def test_top_k_and_top_p_restrict_the_support():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 400))
  rows = jnp.arange(400, dtype=jnp.int32)
  draw = lambda **kw: np.asarray(sampling.sample(
      logits, sampling_rows(400, sample_index=rows, **kw), all_greedy=False))
  assert set(draw(top_k=2)) == {0, 1}
  assert set(draw(top_p=0.7)) == {0, 1}  # 0.5 + 0.3 reaches 0.7
  assert set(draw(top_k=1)) == {0}
  assert set(draw()) == {0, 1, 2, 3}
  counts = np.bincount(draw(), minlength=4) / 400
  np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.08)
  greedy = sampling.sample(logits, sampling_rows(400, temperature=0.0), all_greedy=False)
  assert not np.any(np.asarray(greedy))


def test_batch_padding_points_at_the_null_page():
  request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, seed=7))
  seq = ScheduledSequence("a", [1, 2, 3, 4, 5], 0, [3, 9], True, True, request)
  batch, info = batch_lib.build([seq], page_size=4)
  assert batch.token_ids.shape == (8,) and batch.page_tables.shape == (1, 2)
  np.testing.assert_array_equal(batch.slot_mapping, [12, 13, 14, 15, 36, 0, 0, 0])
  np.testing.assert_array_equal(batch.query_start_loc, [0, 5])
  assert batch.context_lens[0] == 5 and batch.logits_indices[0] == 4 and batch.seeds[0] == 7
  assert info.samples == [True] and info.all_greedy
  too_long = ScheduledSequence("a", [1] * 9, 0, [3, 9], True, True, request)
  with pytest.raises(ValueError, match="do not fit"):
    batch_lib.build([too_long], page_size=4)
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    batch_lib.bucket(10**6, batch_lib.TOKEN_BUCKETS, "num_tokens")


def test_step_donates_the_cache(params):
  engine = tiny_engine(params)
  before = engine.executor.cache.k_pages
  engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
  assert before.is_deleted()  # donated into the step, updated in place
  assert isinstance(engine.executor.cache.k_pages, jax.Array)


def test_warmup_compiles_every_shape_serving_then_uses(params):
  config = tiny_config.get_config()
  config.scheduler.update(dict(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32))
  engine = build.jax_engine(llama, MODEL, params, config.scheduler, num_pages=64, page_size=16)
  num_programs = engine.executor.warmup(8, 64)
  assert engine.executor.num_compiles == num_programs == 4 + 4  # decode 1-8, mixed 8-64
  trace = workload.synthesize(num_requests=12, arrival_rate=float("inf"),
                              prompt_len="uniform:1:70", output_len="uniform:1:20",
                              vocab_size=MODEL.vocab_size, seed=0)
  replay.replay(engine, trace, make_sampling=lambda item: SamplingParams(
      max_tokens=item.output_len, ignore_eos=True))
  assert engine.scheduler.stats()["num_finished"] > 0
  assert engine.executor.num_compiles == num_programs  # nothing compiled on the request path


def test_argmax_is_the_first_maximum_like_jnp_argmax():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((16, 300)).astype(np.float32)
  logits[3, [7, 200]] = 50.0  # a tie: the first index wins
  logits[5, :] = 1.0  # all equal
  logits = jnp.asarray(logits)
  expected = jnp.argmax(logits, axis=-1)
  assert sampling.argmax(logits).tolist() == expected.tolist()
  assert sampling.argmax(logits)[3] == 7 and sampling.argmax(logits)[5] == 0
  assert sampling.argmax(jnp.asarray([[1.0, jnp.nan, 2.0]]))[0] == 2  # in range, even so


def test_a_packed_batch_unpacks_to_the_same_fields_bit_for_bit():
  batch = batch_lib.example_batch(8, 4, 3, decode_only=True)
  rng = np.random.default_rng(0)
  for field in batch:
    field[...] = rng.integers(-(2**31), 2**31 - 1, field.shape).astype(np.int64).astype(
        field.dtype) if field.dtype != np.float32 else rng.normal(size=field.shape)
  batch.seeds[:] = [0, 2**32 - 1, 12345, 2**31]
  packed, layout = batch_lib.pack(batch)
  assert packed.dtype == np.int32 and packed.ndim == 1
  unpacked = jax.jit(step_lib._unpack, static_argnums=1)(jax.device_put(packed), layout)
  assert type(unpacked) is batch_lib.DecodeStepBatch
  for name, original, restored in zip(batch._fields, batch, unpacked, strict=True):
    restored = np.asarray(restored)
    assert restored.dtype == original.dtype and restored.shape == original.shape, name
    assert restored.tobytes() == original.tobytes(), name
