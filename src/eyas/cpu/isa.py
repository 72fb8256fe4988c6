"""What this CPU's instruction set offers, as the CPU tricks and the dtype policy
(`targets.devices`) need to know it."""

from __future__ import annotations

import torch


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (bf16 matrix products far faster than AVX512-BF16's)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512-BF16 (native bf16 matrix products, slower than AMX's)."""
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
