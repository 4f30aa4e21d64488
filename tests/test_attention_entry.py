"""`kvpage.device.backends.Ops.attention`: one entry point over every implementation.

Each `impl` reads one layer of a whole `[num_layers, ...]` cache and agrees with the
oracle on that layer's pages; an unknown `impl` is refused by name; the Pallas package
is imported only when chosen.
"""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_case
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvpage.device import backends
from kvpage.device.attention import reference

DECODE_SEQS = [(1, 1), (3, 1), (17, 1), (40, 1)]
MIXED_SEQS = [(40, 1), (17, 17), (29, 11)]


def whole_cache_call(impl, case, decode_only, layer=1, num_layers=2):
  """`Ops.attention` of the run choice `impl`, with `case`'s pages as layer `layer` of
  a zero-filled cache."""
  k, v = (jnp.zeros((num_layers, *x.shape), x.dtype).at[layer].set(x)
          for x in (case.k_pages, case.v_pages))
  ops = backends.Ops(backends.RunChoices(attention_impl=impl))
  return ops.attention(jnp.asarray(case.q), k, v, layer=layer, **case.kwargs(),
                       decode_only=decode_only)


# `mosaic` runs on CPU through Mosaic GPU's interpreter, which jax >= 0.11.2 has.
IMPLS = [pytest.param(impl, marks=pytest.mark.skipif(
    impl == "mosaic" and not hasattr(plgpu, "InterpretGPUParams"),
    reason="Mosaic GPU's interpreter needs jax >= 0.11.2")) for impl in
    backends.ATTENTION_IMPLS]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seqs,decode_only", [(DECODE_SEQS, True), (MIXED_SEQS, False)],
                         ids=["decode", "mixed"])
def test_every_impl_matches_the_oracle_on_its_layer(impl, seqs, decode_only):
  case = make_case(seqs, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, seed=4,
                   num_pad_tokens=2, num_pad_seqs=1)
  expected = reference.ragged_paged_attention(
      jnp.asarray(case.q), jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
      **case.kwargs())
  out = whole_cache_call(impl, case, decode_only)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_an_unknown_impl_raises_naming_the_choices():
  case = make_case([(5, 1)], num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, seed=0)
  with pytest.raises(ValueError, match="'triton': choose one of xla, cpu, reference, pallas"):
    whole_cache_call("triton", case, decode_only=True)


def test_decode_only_must_be_a_static_bool():
  case = make_case([(5, 1)], num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, seed=0)
  with pytest.raises(TypeError, match="static Python bool"):
    whole_cache_call("xla", case, decode_only=jnp.asarray(True))


def test_the_kernels_are_imported_only_when_chosen():
  code = ("import sys; import models.llama; import kvpage.device.backends; "
          "print(any(m.startswith('kvpage.device.backends.pallas') for m in sys.modules))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
  assert result.stdout.strip() == "False"
