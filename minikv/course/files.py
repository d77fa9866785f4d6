"""Writing files safely: every file the course writes goes through here."""
from __future__ import annotations

import os
from pathlib import Path


def check_writable(directory: str | Path) -> None:
    """Raise a clear ValueError, before any work, if `directory` cannot be created or replaced."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory: choose another path")
    parent = directory.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {parent} ({e.strerror}): choose a writable path") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{parent} is not writable: choose a writable path")


def write_atomically(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it over `path`: a reader (or
    an interrupted writer) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
