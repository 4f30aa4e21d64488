"""The host world: requests, the page pool, admission, the scheduler and the engine loop.

Pure Python (numpy at most): nothing here imports jax, jaxlib, flax, optax, chex or
`kvpage.device`: it hands an executor plain data through the contract in
`kvpage.interface` (`tests/test_layering.py` reads the imports and fails if one does).
"""
