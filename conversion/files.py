"""The files of a checkpoint, read as untrusted input: each one where it belongs, of the kind it must be, and
no larger than it can be. No torch here: the command line reads configs with these before it imports anything.

A file a checkpoint folder names is read (or copied into an output) only when, its links resolved, it lies in
that folder (`confined`): a link to a file elsewhere would carry that file's content into whatever the
conversion writes, or have a command read any file the user can. The one exception is the Hugging Face
Hub's cache, where `<repo>/snapshots/<revision>/` holds links to `<repo>/blobs/`: a folder inside a snapshot
may link into its repository's blobs. Only a regular file is opened (a FIFO would block the open forever,
a device such as /dev/zero never ends), and a file read whole is read up to a bound (`read_bytes`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from modelzoo.conversion.errors import CheckpointError

# the most a small file of a checkpoint (a config, an index, a tracker, modelzoo's own JSON) can hold
MAX_JSON_BYTES = 64 * 2**20
# JSON nested deeper than this is not a configuration (nor an index, a token list, ...)
MAX_JSON_DEPTH = 64

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _allowed_places(root: Path) -> list[Path]:
    """Where the files of folder `root` may really lie: in it, and, for a folder inside a Hub cache's
    snapshot, in that repository's blobs."""
    real = root.resolve()
    places = [real]
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots":  # <repo>/snapshots/<revision>
            places.append(folder.parent.parent / "blobs")
            break
    return places


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def confined(path: str | os.PathLike, root: str | os.PathLike, folder: bool = False) -> Path:
    """`path` itself when, its links resolved, it lies in folder `root` (`_allowed_places`) and is a regular file
    (`folder`: a folder); else CheckpointError naming it. Checks before anything opens it."""
    path, root = Path(path), Path(root)
    real = path.resolve()
    if not any(real == place or real.is_relative_to(place) for place in _allowed_places(root)):
        raise CheckpointError(f"{path} leads outside {root} (to {real}): a checkpoint's files must lie in its folder")
    try:
        mode = real.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    if folder and not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path} is {_kind(mode)}, not a folder")
    if not folder and not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is {_kind(mode)}, not a regular file: refused before opening it")
    return path


def regular_file(path: str | os.PathLike) -> Path:
    """`path` when it is a regular file (links followed, wherever they lead: a file the user names), else
    CheckpointError: a FIFO or a device is refused before it is opened."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is {_kind(mode)}, not a regular file: refused before opening it")
    return path


def read_bytes(path: Path, limit: int, root: str | os.PathLike | None = None) -> bytes:
    """The bytes of file `path` (confined to `root`, or any regular file when None), at most `limit` of them:
    a longer one is refused. Opened without blocking and checked again once open, so that a file swapped for
    a FIFO or a device after the check is refused too."""
    path = confined(path, root) if root is not None else regular_file(path)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path} is {_kind(mode)}, not a regular file: refused")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} holds more than {limit} bytes, more than such a file can hold: refused")
    return data


def _depth_at_most(value, limit: int) -> bool:
    """Whether the containers of a parsed JSON value nest `limit` deep at most (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def read_json(path: str | os.PathLike, root: str | os.PathLike | None = None, what: type = dict,
              limit: int = MAX_JSON_BYTES):
    """The JSON value of file `path` (see `read_bytes`), which must be UTF-8 text without a byte-order mark,
    nest at most `MAX_JSON_DEPTH` deep and be a `what` (dict: a JSON object; list: an array); else one error
    naming the file."""
    path = Path(path)
    data = read_bytes(path, limit, root)
    if data.startswith(b"\xef\xbb\xbf"):
        raise CheckpointError(f"{path} is not JSON: it starts with a byte-order mark")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {error.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels: refused") from None
    except ValueError as error:  # not JSON, or an integer of more digits than Python converts
        raise CheckpointError(f"{path} is not JSON ({error})") from None
    if not _depth_at_most(value, MAX_JSON_DEPTH):
        raise CheckpointError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels: refused")
    if not isinstance(value, what):
        expected = {dict: "a JSON object", list: "a JSON list"}.get(what, what.__name__)
        raise CheckpointError(f"{path} must hold {expected}, not {_json_type(value)}")
    return value


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)



def check_files_of(folder: str | os.PathLike) -> None:
    """Every file of `folder` (not of its subfolders) `confined` to it: for a reader that opens whichever of them
    it looks for (transformers' `from_pretrained`: configs, weights, generation config, an adapter's config)."""
    folder = Path(folder)
    with os.scandir(folder) as entries:
        for entry in entries:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False) or not path.exists():  # a dangling link is read by no one
                continue
            confined(path, folder, folder=path.is_dir())
