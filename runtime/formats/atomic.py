"""Atomic file and folder writes: write beside the target, then rename.

What a writer puts beside its target is named ``.NAME.PID.XXXXXXXX`` plus ``.tmp`` (a file being
written), ``.partial`` (a folder being built) or ``.old`` (the folder being replaced, moved aside).
A killed writer leaves them behind; the next write of the same target (``atomic_write_bytes``,
``staging_folder``) or ``clean_leftovers`` removes those whose process is gone, and puts back a
folder that a replace killed between its two renames had moved aside.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace path with data; a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Replace path with UTF-8 text atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """Yield a temporary folder beside target; it replaces target only if the block succeeds. At every
    instant target holds the old folder or the new one, except between two renames, where a kill leaves
    the old one moved aside for the next run to put back."""
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=_prefix(target), suffix=".partial"))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        _replace_folder(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def clean_leftovers(target: Path) -> None:
    """Remove what killed writers of target left beside it; put back the old folder when a replace was
    killed after moving it aside and before renaming the new one in."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:(\d+)\.)?[a-z0-9_]+\.(tmp|partial|old)")
    for leftover in sorted(target.parent.iterdir()):
        match = pattern.fullmatch(leftover.name)
        if not match or (match[1] and _running(int(match[1]))):
            continue
        if match[2] == "old" and not os.path.lexists(target):
            os.replace(leftover, target)
        elif leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _replace_folder(new: Path, target: Path) -> None:
    """Move the old target aside, rename new in, then delete the old one; a failed rename-in puts it back."""
    if not os.path.lexists(target):
        os.replace(new, target)
        return
    aside = new.with_name(new.name.removesuffix(".partial") + ".old")
    os.replace(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _prefix(target: Path) -> str:
    """The start of the name of a file or folder this process writes beside target."""
    return f".{target.name}.{os.getpid()}."


def _running(pid: int) -> bool:
    """Whether a process with this id exists (POSIX)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
