"""The backends seam (`kvpage.device.backends`): run choices, cost traits, what runs.

The registry is the one place that maps a model's run choices to code. Its answers
are what the rest of kvpage asks instead of naming a backend: the traits decide how
the simulator prices a padded decode and how large the memory plan's reserve is, and
`describe` is what the run records say ran. Each is checked here against the backend
it names.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config

from kvpage.device import backends
from kvpage.device.backends.cpu import native
from kvpage.device.backends.xla import attention as xla_paths


def model(**choices):
  config = tiny_config.get_config().model
  config.update(choices)
  return config


@pytest.mark.parametrize("name,value", [("attention_impl", "triton"),
                                        ("linear_impl", "amx"),
                                        ("matmul_precision", "tf32")])
def test_a_choice_outside_its_names_is_refused_naming_them(name, value):
  with pytest.raises(ValueError, match=f"{name} '{value}': choose one of"):
    backends.check(model(**{name: value}))


def test_a_section_without_choices_runs_on_xla_at_the_default_precision():
  section = model()
  for name in ("attention_impl", "linear_impl", "matmul_precision"):
    del section[name]
  choices = backends.check(section)
  assert choices == backends.RunChoices() and choices.precision is None
  written = model()
  choices.write(written)
  assert (written.attention_impl, written.linear_impl) == ("xla", "xla")


def test_the_xla_backend_pads_decode_rows_and_keeps_its_products_apart():
  traits = backends.traits(model(attention_impl="xla", linear_impl="xla"))
  assert traits.decode_reads_longest and not traits.swiglu_fused
  assert (traits.decode_tokens_per_tile, traits.prefill_query_block,
          traits.prefill_tokens_per_tile) == (xla_paths.DECODE_TOKENS_PER_TILE,
                                              xla_paths.PREFILL_QUERY_BLOCK,
                                              xla_paths.PREFILL_TOKENS_PER_TILE)


def test_the_oracle_and_the_pallas_kernels_read_each_rows_own_context():
  for impl in ("reference", "pallas", "mosaic"):
    assert not backends.traits(model(attention_impl=impl)).decode_reads_longest, impl


def test_the_cpu_backend_says_which_rows_and_products_its_kernels_take():
  assert native.status() == "ready", native.status()
  traits = backends.traits(model(attention_impl="cpu", linear_impl="cpu"))
  assert not traits.decode_reads_longest and traits.swiglu_fused
  # A head size the kernels are not built for leaves decode rows to the XLA pass.
  odd = model(attention_impl="cpu", head_dim=48, num_heads=4, num_kv_heads=2)
  assert backends.traits(odd).decode_reads_longest
  assert backends.describe(odd)["attention"] == "decode rows xla, prompt chunks xla"
  # A tensor-parallel step keeps its products on XLA's partitioner.
  assert not backends.traits(model(linear_impl="cpu"), tensor_parallel=2).swiglu_fused


def test_the_record_names_what_ran_and_the_native_library_only_where_chosen():
  chosen = backends.describe(model(attention_impl="cpu", linear_impl="cpu"))
  assert chosen["attention"] == "decode rows native, prompt chunks native"
  assert chosen["linear"].startswith("native up to")
  assert chosen["native"]["status"] == "ready" and chosen["native"]["variant"]
  plain = backends.describe(model(attention_impl="xla", linear_impl="xla"))
  assert (plain["attention"], plain["linear"], plain["device"]) == ("xla", "xla", "cpu")
  assert "native" not in plain
  assert backends.describe(model(attention_impl="pallas"))["attention"] == (
      "pallas (Triton), interpreted")
  products = backends.describe(model(linear_impl="cpu"), tensor_parallel=2)["linear"]
  assert products == "xla (tensor parallel)"


def test_ops_compute_the_same_products_on_either_backend():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w, gate, up = (jnp.asarray(rng.standard_normal((64, 96)) * 0.1, jnp.float32)
                 for _ in range(3))
  scale, residual = jnp.ones(64), jnp.asarray(rng.standard_normal((8, 96)), jnp.float32)
  outs = []
  for impl in ("xla", "cpu"):
    ops = backends.ops(model(linear_impl=impl, matmul_precision="highest"))
    (projected,) = ops.project(x, [w], norm=(scale, 1e-5), residual=residual)
    outs.append((projected, ops.swiglu(x, gate, up, norm=(scale, 1e-5))))
  for ours, theirs in zip(outs[1], outs[0]):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
