"""Which GPU architecture a tensor lives on.

Only backend verifiers (``cula/<op>/backends.py``) read this; kernel classes never query torch, so
they can be traced and compiled for any target on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch


def _parse_arch(text: str) -> tuple[int, int]:
    digits = text.strip().lower().removeprefix("sm_").rstrip("a")
    if not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"CULA_ARCH must look like '90', 'sm_90a' or '100', got {text!r}")
    return int(digits[:-1]), int(digits[-1])


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_arch(device: torch.device | torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) compute capability of ``device`` (or a tensor's device); None on the CPU.

    ``CULA_ARCH`` (e.g. ``90`` or ``sm_100a``) overrides what the driver reports, for tests.
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    if device.type != "cuda":
        return None
    override = os.environ.get("CULA_ARCH")
    if override:
        return _parse_arch(override)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


def compile_target(arch: tuple[int, int]) -> str:
    """The ptxas target for an architecture: sm_90a for Hopper, sm_100a for Blackwell."""
    major, minor = arch
    return f"sm_{major}{minor}a"
