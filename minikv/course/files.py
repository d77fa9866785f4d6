"""Reading and writing files safely: every file the course writes goes through here, and every
file a user can point it at is read through `read_at_most`."""
from __future__ import annotations

import os
import re
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


PACKAGE = Path(__file__).resolve().parents[1]
# The file that says which command a folder belongs to. A command writes a folder only if it is
# new, empty, or marked as that command's: `--out .`, `--out ~` or a folder of a user's files is
# refused by name before any work, never replaced or written into.
MARKER = ".minikv-output"


def marker_text(command: str) -> str:
    return (f"python -m minikv {command}\n# the first line names the command this folder is the "
            "output of: it may replace or rewrite what it wrote here; delete this file to keep "
            "the folder from it\n")


def owner(directory: Path) -> str | None:
    """The command whose marker `directory` holds, or None."""
    try:
        first = read_at_most(directory / MARKER, 4096, "marker", "").decode().split("\n")[0]
    except (ValueError, UnicodeDecodeError):
        return None
    named = re.fullmatch(r"python -m minikv ([a-z-]+(?: --[a-z-]+)?)", first)
    return named.group(1) if named else None


def claim_directory(directory: str | Path, command: str, *, replace: bool = False,
                    force: bool = True, own: str | None = None) -> Path:
    """Check, before any work, that `command` may write the folder `directory`: it is new,
    empty, or marked as `command`'s output (MARKER); for a command that replaces the whole
    folder (`replace`), a marked one only with `force`. Anything else (a file, a folder of a
    user's files, the repository, a folder holding the package, a place inside the package) is
    a ValueError naming it and saying what to do. `own`: a regular expression for the names of
    files `command` wrote before folders were marked (they count as its own)."""
    directory = Path(directory)
    how = f"`python -m minikv {command}`"
    try:
        resolved = directory.resolve()
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot resolve {directory} ({e}): choose another folder") from None
    if resolved == PACKAGE or PACKAGE in resolved.parents:
        raise ValueError(f"{directory} is inside the minikv package: write elsewhere "
                         f"(runs/...)")
    check_writable(directory)
    if not directory.exists():
        return directory
    try:
        names = sorted(p.name for p in directory.iterdir())
    except OSError as e:
        raise ValueError(f"cannot list {directory} ({e.strerror}): choose another folder") from None
    # our own marker's temporary file (a writer that stopped halfway) is not a user's
    names = [n for n in names if not n.startswith(f"{MARKER}.tmp-")
             and not (own and re.fullmatch(own, n))]
    if not names:
        return directory
    marked = owner(directory)
    if marked == command:
        if replace and not force:
            raise ValueError(f"{directory} holds an earlier {how}'s output: pass --force to "
                             "replace it, or choose another --out")
        return directory
    if (resolved / "minikv" / "__init__.py").is_file() or (resolved / "__init__.py").is_file():
        what = "it holds the minikv package (or another Python package)"
    elif marked is not None:
        what = f"it is `python -m minikv {marked}`'s output"
    else:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = f"it holds files {how} did not write ({shown})"
    refusal = "replaces" if replace else "writes into"
    raise ValueError(f"{directory}: {what}; {how} {refusal} only a new or empty folder, or one "
                     f"it wrote before: choose another --out (e.g. runs/...)")


def mark_directory(directory: str | Path, command: str) -> Path:
    """Create `directory` if need be and mark it as `command`'s (after claim_directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if owner(directory) != command:
        write_atomically(directory / MARKER, marker_text(command))
    return directory


def replace_directory(directory: str | Path, fill, mark: str | None = None) -> Path:
    """Write a directory's files with `fill(tmp)` into a temporary sibling, flush them to disk,
    then swap it in for `directory` at once: a reader, a crash or a Ctrl-C (held until the swap
    is done) never sees half of it. Every file gets the mode the umask gives a new file (a
    library may write its own way: safetensors makes its files readable by their owner only).
    `mark`: the command whose marker the new directory holds (claim_directory)."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.writing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        if mark is not None:
            (tmp / MARKER).write_text(marker_text(mark))
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
