"""Reading and writing files safely: every file the course writes goes through here, and every
file a user can point it at is read through `read_at_most`."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import threading
from contextlib import contextmanager
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


def replace_directory(directory: str | Path, fill) -> Path:
    """Write a directory's files with `fill(tmp)` into a temporary sibling, flush them to disk,
    then swap it in for `directory` at once: a reader, a crash or a Ctrl-C (held until the swap
    is done) never sees half of it. Every file gets the mode the umask gives a new file (a
    library may write its own way: safetensors makes its files readable by their owner only)."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.writing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        probe = tmp / ".mode"
        probe.touch()
        mode = stat.S_IMODE(probe.stat().st_mode)
        probe.unlink()
        for path in tmp.rglob("*"):
            if path.is_file():
                os.chmod(path, mode)
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        _swap(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


@contextmanager
def _sigint_held():
    """Hold a Ctrl-C until the block is done, then raise it: a swap is never left halfway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _swap(new: Path, directory: Path) -> None:
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    with _sigint_held():
        if directory.exists():
            os.rename(directory, old)
        os.rename(new, directory)
    shutil.rmtree(old, ignore_errors=True)


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


def read_at_most(path: str | Path, limit: int, what: str, fix: str) -> bytes:
    """The bytes of the regular file at `path`, or a ValueError ("cannot read `what` `path`
    (why); `fix`") for a missing file, a directory, a pipe or a file over `limit` bytes, decided
    before any byte is read: a file's size is never trusted to say how much memory to take."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a named pipe must not wait for a writer; regular files ignore it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ValueError(f"cannot read {what} {path} ({e.strerror}); {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a directory opens too, on Linux
            raise ValueError(f"cannot read {what} {path} (not a regular file); {fix}")
        if info.st_size > limit:
            raise ValueError(f"cannot read {what} {path} ({info.st_size:,} bytes, more than the "
                             f"{limit:,} it can be); {fix}")
        with os.fdopen(os.dup(fd), "rb") as f:
            # read(n) allocates n bytes up front: ask for the size, not the limit; + 1 byte
            # catches a file that grew since fstat
            data = f.read(info.st_size + 1)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path} ({e.strerror}); {fix}") from None
    finally:
        os.close(fd)
    if len(data) > info.st_size:
        raise ValueError(f"cannot read {what} {path} (it grew while it was read): try again "
                         f"once nothing writes to it")
    return data
