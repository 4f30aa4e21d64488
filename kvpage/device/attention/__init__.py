"""Paged attention's contract: the oracle, `reference.ragged_paged_attention`.

Every implementation computes what the oracle computes, causal attention of a ragged
batch of new tokens over a paged KV cache, and shares its input checks, token layout
and online-softmax update. The implementations are the backends'
(`kvpage.device.backends`: the XLA paths, the CPU kernels, the Pallas kernels), chosen
by a model's run choices; the tests check each against the oracle.
"""
