"""Where the engine runs: CUDA when present, then Apple's MPS, else the CPU."""
from __future__ import annotations

import os

import torch


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def default_device() -> torch.device:
    """The best available device; set MINIKV_DEVICE (e.g. "cpu", "cuda:1") to choose another."""
    requested = os.environ.get("MINIKV_DEVICE")
    if requested:
        return resolve_device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if _mps_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` as a torch.device, checked to exist here; None means `default_device()`."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'mps'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here; use 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} "
                         f"CUDA device(s) exist")
    if dev.type == "mps" and not _mps_available():
        raise ValueError(f"device {device!r} requested but MPS is not available here; use 'cpu'")
    return dev


def describe_device(device: torch.device) -> str:
    """A one-line description for notebooks: the device and, on CUDA, the GPU's name."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: CUDA's own count, or on a CPU the memory the OS reports
    available (Linux; elsewhere a ValueError naming --num-blocks)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise ValueError("this OS does not report its free memory: give --num-blocks") from None
