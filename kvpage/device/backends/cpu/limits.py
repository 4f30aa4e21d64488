"""What the native CPU kernels take, and what the library holds: defined here, once.

Plain literals only (no imports, no expressions): `setup.py` reads this file without
importing kvpage and writes each constant into the header the C++ is compiled with
(`kvpage_build.h`, generated in the build directory: `MAX_GROUP` becomes
`kvpage::limits::kMaxGroup`, `HEAD_DIMS` the array `kHeadDims`, `TARGETS` the handler
table), so the kernels and the Python wrappers (`attention.py`, `linear.py`) share these
values. `native.py` reads them back from the loaded library and refuses a library that
disagrees (one built from other sources); `tests/test_native.py` checks both sides.
"""

# Head sizes the attention kernels are instantiated for: whole vectors of 16 floats.
HEAD_DIMS = (16, 32, 64, 128, 256)
# Query heads per KV head the decode kernel handles (paged_attention.cc).
MAX_GROUP = 16
# Result columns a task of the fp32 linear kernel computes (two vectors, linear.cc): a
# weight's columns must be a multiple of it (linear.h), for the AMX kernel as well.
PANEL = 32
# The bf16x3 (AMX) prompt-chunk attention takes head sizes that are multiples of this
# (the 32 inner elements one tile multiply folds, amx.h); others run in fp32.
BF16X3_HEAD_DIM_MULTIPLE = 32

# The FFI targets' registered names, and the handler symbols behind them: the library
# holds each handler once per variant, as `<symbol>_<variant>`, and looks them up by
# (symbol, variant) (`KvpageHandler`); a handler missing from a variant fails the link.
TARGETS = {"kvpage_paged_decode": "KvpagePagedDecode",
           "kvpage_paged_prefill": "KvpagePagedPrefill",
           "kvpage_paged_prefill_bf16x3": "KvpagePagedPrefillBf16x3",
           "kvpage_linear": "KvpageLinear",
           "kvpage_swiglu": "KvpageSwiglu",
           "kvpage_linear_bf16x3": "KvpageLinearBf16x3",
           "kvpage_swiglu_bf16x3": "KvpageSwigluBf16x3"}

# The library's variants of every kernel, each compiled for one instruction set
# (setup.py's flags), the least demanding first: the loader (`native.py`) takes the last
# one this CPU runs.
VARIANTS = ("avx2", "avx512", "amx")
