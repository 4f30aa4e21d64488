"""The device world: the paged KV cache, attention, sampling, the jitted step, `JaxExecutor`.

Everything here works on jax arrays; the step never touches Python request objects.
It meets the host world only through `kvpage.interface` and `kvpage.batch`.
"""
