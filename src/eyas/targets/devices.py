"""Devices and dtypes: parsing `--device` / `--dtype`, and what `--dtype auto` means on this machine."""

from __future__ import annotations

import os

import torch

from eyas.cpu.isa import cpu_has_amx, cpu_has_avx512_bf16
from eyas.errors import EyasError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """Map `fp32|bf16|fp16` to a torch dtype; anything else is a usage error."""
    if name not in DTYPES:
        raise EyasError(f"--dtype {name!r} is not supported; use one of {', '.join(DTYPES)} or auto")
    return DTYPES[name]


def fast_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` means on `device`: `bf16` where bf16 matrix multiplies are native
    (CUDA with bf16 support; CPUs with AMX or AVX512-BF16), else `fp32`: without either, bf16
    runs far slower than fp32 (docs/cpu-performance.md, "bf16, AMX and `--dtype auto`")."""
    dev = parse_device(device)
    if dev.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_amx() or cpu_has_avx512_bf16() else "fp32"


def decode_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` means for decoding (`eyas bench`, the quickstart's bench stage):
    `fast_dtype`, except fp32 on a CPU without AMX: with AVX512-BF16 alone, one-query bf16
    attention is slow and prepacked fp32 decodes faster; with AMX bf16 is faster
    (docs/cpu-performance.md)."""
    dt = fast_dtype(device)
    if dt == "bf16" and parse_device(device).type == "cpu" and not cpu_has_amx():
        return "fp32"
    return dt


def parse_device(name: str) -> torch.device:
    """Validate `--device` (`cpu`, `cuda`, `cuda:N`, `auto`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise EyasError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from e
    if device.type not in ("cpu", "cuda"):
        raise EyasError(f"--device {name}: eyas runs on cpu or cuda; use cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"--device {name} requested but CUDA is not available; use --device cpu")
    if device.type == "cuda":
        avoid_cudnn_attention()
    return device


def avoid_cudnn_attention() -> None:
    """Keep torch's sdpa off its cuDNN backend, process-wide (flash, memory-efficient and math
    remain). On sm90/sm100 with a recent cuDNN, torch puts cuDNN first for bf16/fp16 and
    builds one cuDNN execution plan per new (batch, query length, key length) shape, cached
    and never reused by the next decoding step, whose key length is one longer. Decoding,
    batched regeneration and variable-length training batches meet a new shape almost every
    call (measured on an H200: docs/results/gpu-h200.md; `bench/gpu_check.py --decode` times
    both settings). `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` is torch's own switch for this."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def prepack_for_decoding(model, weights: str = "fp32") -> int:
    """Prepack an fp32 CPU model's linear weights for few-row forwards (`cpu.prepack`; fp16
    weights for a drafter) when the packed copies take at most half of the memory available
    now; returns how many."""
    from eyas.cpu import prepack

    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return prepack.prepack(model, budget_bytes=avail // 2, weights=weights)
