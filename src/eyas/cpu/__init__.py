"""CPU speed tricks, behind one boundary. Each replaces a plain path that stays in the code and
is what it is tested against; none changes a result beyond floating-point order.

- `prepack`: oneDNN-packed linear weights for few-row forwards (plain: `nn.Linear`); outputs
  equal the unpacked model's (tests/cpu/test_prepack.py, tests/core/test_speculative.py).
- `attention`: attention overrides for verification and batched regeneration (plain:
  transformers' sdpa / eager attention); equal outputs (tests/core/test_speculative.py, tests/cpu/test_attention.py).
- `hostmem`: glibc keeps freed large buffers for reuse instead of returning them to the OS
  (plain: glibc's defaults; `EYAS_MALLOC=default`), tests/cpu/test_hostmem.py.
- `isa`: what this CPU offers (AMX, AVX512-BF16), for the tricks above and the dtype policy
  (`targets.devices`).

The chunked head loss of training lives with the loss it computes (`core.ttt.target_table`,
checked against the unchunked table in tests/core/test_ttt.py). Where each trick pays, and by how
much, is in docs/cpu-performance.md.
"""
