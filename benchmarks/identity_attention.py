"""Attention replaced by the identity, in kvpage and in Hugging Face `transformers` alike.

`benchmarks/decode_floor.py` times each framework without its attention (every
layer's attention output is its query), to see what the rest of the step costs. Both
sides must then be the same network; `tests/test_decode_floor.py` checks that their
logits agree. No flags here, so tests can import it.
"""

import contextlib
from collections.abc import Iterator

from kvpage.device import backends

HF_NAME = "kvpage_identity"  # the name registered with transformers' AttentionInterface


def hf_identity(module, query, key, value, attention_mask, **kwargs):
  """HF's attention interface: `query [batch, heads, tokens, head_dim]` back as the output
  `[batch, tokens, heads, head_dim]`, keys and values (already cached) left unread."""
  del module, key, value, attention_mask, kwargs  # Unused: nothing is attended.
  return query.transpose(1, 2).contiguous(), None


def register_hf() -> str:
  """Registers `hf_identity` with transformers; returns its `attn_implementation` name."""
  import transformers  # test extra only: kvpage itself never imports it

  transformers.AttentionInterface.register(HF_NAME, hf_identity)
  return HF_NAME


def _kvpage_identity(ops, q, k_pages, v_pages, **kwargs):
  """`kvpage.device.backends.Ops.attention`'s signature; the query comes back unchanged."""
  del ops, k_pages, v_pages, kwargs  # Unused: nothing is attended.
  return q


@contextlib.contextmanager
def in_kvpage() -> Iterator[None]:
  """Models traced inside trace the identity for `kvpage.device.backends.Ops.attention`."""
  original = backends.Ops.attention
  backends.Ops.attention = _kvpage_identity
  try:
    yield
  finally:
    backends.Ops.attention = original
