"""Pallas kernels for the paged-attention hot path, behind the reference's signature.

`paged_attention.ragged_paged_attention` is the entry point (what the jitted step
calls for `attention_impl = "pallas"`); it dispatches to the Flash-Decoding kernel in
`decode_attention` or the ragged mixed-batch kernel in `ragged_attention`. Shared
pieces and the choice of GPU lowering (Triton, and why) live in `common`. Every
kernel takes `interpret=`; on CPU only interpret mode runs.
"""
