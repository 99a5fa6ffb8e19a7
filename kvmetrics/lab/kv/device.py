"""Where the data plane's tensors live, and in which floating-point type.

The data plane runs on CUDA when a GPU is present and on the CPU otherwise;
``auto`` picks for the caller. Asking for ``cuda`` on a machine without one is a
configuration error the user can fix, so it is a ``ValueError`` with a message
that says what torch sees, never a crash deep inside a kernel launch.
"""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")

#: KV dtypes the data plane accepts: float32 (default, exact), or the half types
#: real engines store KV in.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda`` (or ``cuda:N``) into a usable :class:`torch.device`."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {spec!r}")
    name = spec.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            built = "with" if torch.backends.cuda.is_built() else "without"
            raise ValueError(
                f"device {spec!r} requested but no CUDA device is available (torch "
                f"{torch.__version__} built {built} CUDA); use --device auto or --device cpu")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
        return device
    raise ValueError(f"device must be one of {DEVICE_CHOICES} (or cuda:N), got {spec!r}")


def resolve_dtype(spec: str | torch.dtype = "float32") -> torch.dtype:
    """Turn a dtype name (or a torch dtype) into one of :data:`DTYPES`."""
    if isinstance(spec, torch.dtype):
        if spec in DTYPES.values():
            return spec
        raise ValueError(f"KV dtype must be one of {tuple(DTYPES)}, got {spec}")
    dtype = DTYPES.get(str(spec).strip().lower())
    if dtype is None:
        raise ValueError(f"KV dtype must be one of {tuple(DTYPES)}, got {spec!r}")
    return dtype


def available_devices() -> list[str]:
    """Devices a test matrix should cover on this machine: CPU always, CUDA if present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
