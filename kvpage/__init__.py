"""kvpage: hold the KV-cache memory line first, push back in tokens and blocks.

Host world (pure Python + numpy, never imports jax): `capacity`, `request`,
`page_pool`, `scheduler`, `batch` (the one bridge). Device world (jax):
`paged_cache`, `attention`, `kernels`, `step`, `sampling`. See shared/DESIGN.md.
"""

__version__ = "0.1.0"
