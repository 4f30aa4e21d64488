"""The host world: requests, the page pool, admission, the scheduler and the engine loop.

Pure Python (numpy at most): nothing here imports jax, flax or `kvpage.device`
(`tests/test_layering.py` reads the imports and fails if one does).
"""
