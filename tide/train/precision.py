"""Which precision to train and recompute in: bf16 only where the hardware multiplies it natively."""

from __future__ import annotations

from pathlib import Path


def use_bf16(precision: str) -> bool:
    from deepspeed.accelerator import get_accelerator

    if precision != "auto":
        return precision == "bf16"
    if get_accelerator().device_name() == "cpu":
        return cpu_has_bf16()
    return bool(get_accelerator().is_bf16_supported())


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively; without it bf16 is slower than float32."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags
