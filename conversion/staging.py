"""Outputs written whole or not at all: staged beside the target under a name that says which host and
process made them, renamed into place on success, removed on failure (and, when a killed run could not
remove them, by the next run for the same target). No torch here: the command line removes stale staging
folders on every path, refusals included.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from modelzoo.conversion.errors import CheckpointError
from modelzoo.processes import check_not_interrupted


# what the system says when an output cannot be written, in the words of the one line reported
_WRITE_FAILURES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.EPERM: "permission denied", errno.EFBIG: "file too large"}


def write_failure(error: BaseException, target: str | os.PathLike) -> CheckpointError | None:
    """The one-line error for an OSError met writing `target` (no space, read-only, ...), else None."""
    if isinstance(error, OSError) and error.errno in _WRITE_FAILURES:
        return CheckpointError(f"{_WRITE_FAILURES[error.errno]} writing {target}; nothing was written")
    return None


def _staging_mark(target: Path) -> str:
    return f".{target.name}.partial-"


def staging_prefix(target: str | os.PathLike) -> str:
    """How this process names what it stages for `target` (a folder, or a file: `.NAME.partial-HOST-PID-`
    and a random part): which host and process made it, to tell a dead run's (`remove_stale_staging`)."""
    return f"{_staging_mark(Path(target))}{socket.gethostname()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet waited for, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: it exists


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove what runs which are gone (killed before they could clean up) staged for `target`: made on
    this host by a process that no longer exists. Returns what it removed."""
    target = Path(target)
    mark, host, removed = _staging_mark(target), socket.gethostname(), []
    try:
        candidates = list(target.parent.glob(glob.escape(mark) + "*"))
    except OSError:
        return []
    for staged in candidates:
        owner = staged.name[len(mark):].rsplit("-", 2)
        if len(owner) != 3 or owner[0] != host or not owner[1].isdigit() or _alive(int(owner[1])):
            continue
        if staged.is_dir() and not staged.is_symlink():
            shutil.rmtree(staged, ignore_errors=True)
        else:
            staged.unlink(missing_ok=True)
        removed.append(staged)
    return removed


def create_staging_folder(target: Path) -> Path:
    """A fresh folder beside `target` (same filesystem, so the final rename is atomic), named after this
    host and process; the staging folders of `target` that dead runs left are removed first."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"output folder {target} already exists; choose a new path or remove it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target), dir=target.parent))
    except OSError as error:
        raise (write_failure(error, target) or error) from None
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the published folder gets normal permissions
    return staging


def publish_staging_folder(staging: Path, target: Path) -> None:
    check_not_interrupted()  # a signal whose exception something swallowed: nothing is published after it
    if target.exists():
        raise CheckpointError(f"output folder {target} appeared while writing; nothing was replaced")
    os.replace(staging, target)


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging folder that becomes `target` on success and disappears on failure (an OSError
    such as a full disk becomes one line naming `target`)."""
    staging = create_staging_folder(Path(target))
    try:
        yield staging
        publish_staging_folder(staging, Path(target))
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        failure = write_failure(error, target)
        if failure is not None:
            raise failure from None
        raise
