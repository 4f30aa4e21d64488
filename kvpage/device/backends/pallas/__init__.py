"""The Pallas backend: the GPU attention kernels (`attention.py`, interpreted on CPU).

`attention` here is what the `pallas` and `mosaic` run choices call: the kernels'
entry, `attention.ragged_paged_attention`, on one layer's pages, with the Triton
Flash-Decoding kernel or its Mosaic GPU twin for decode-only steps and query blocks for
mixed ones. The kernel modules import Pallas, so the registry imports this package only
when one of its choices is made. Products are the XLA backend's.
"""

from typing import Any

import jax


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, layer: int,
              page_tables: jax.Array, context_lens: jax.Array, query_start_loc: jax.Array,
              decode_only: bool, precision: Any = None, decode_kernel: str = "triton"
              ) -> jax.Array:
  """One layer's attention on one device, by the kernels (`decode_kernel`: `triton` or
  `mosaic` for decode-only batches); interpreted where JAX's backend is the CPU. The
  kernels pick decode or mixed themselves, and keep their own precision."""
  del decode_only, precision
  from kvpage.device.backends.pallas import attention as kernels

  return kernels.ragged_paged_attention(q, k_pages[layer], v_pages[layer],
                                        page_tables=page_tables, context_lens=context_lens,
                                        query_start_loc=query_start_loc,
                                        interpret=jax.default_backend() == "cpu",
                                        decode_kernel=decode_kernel)
