"""What a command's processes share that needs no torch: the exception that reports a failed rank and the
signal handling that unwinds like Ctrl-C. Apart from runtime.py (torch.distributed) so that the command line
installs and names them before it knows whether the command needs torch."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


def exception_kinds(error: BaseException) -> tuple[str, ...]:
    """The qualified names of `error`'s class and of every class it derives from: what it is, sent between
    processes (the exception itself may not survive pickling, and its class name alone says nothing of its bases)."""
    return tuple(f"{kind.__module__}.{kind.__qualname__}" for kind in type(error).__mro__)


class RankFailed(RuntimeError):
    """An exception on one rank of `spawn`; `error_type`, `message`, `kinds` (`exception_kinds`) and, for an
    OSError about a file, `filename` are the original's."""

    def __init__(self, rank: int, error_type: str, message: str, remote_traceback: str, kinds: tuple[str, ...] = (),
                 filename: str | None = None):
        super().__init__(f"rank {rank} failed with {error_type}: {message}\n{remote_traceback}")
        self.rank, self.error_type, self.message, self.remote_traceback = rank, error_type, message, remote_traceback
        self.kinds, self.filename = kinds, filename

    def is_a(self, *classes: type[BaseException]) -> bool:
        """Whether the rank's exception was an instance of one of `classes` (subclasses included)."""
        return any(f"{kind.__module__}.{kind.__qualname__}" in self.kinds for kind in classes)


class RankDied(RuntimeError):
    """A rank of `spawn` ended without a word (killed: `exit_code` is minus the signal's number)."""

    def __init__(self, rank: int, exit_code: int):
        how = f"was killed by signal {-exit_code}" if exit_code < 0 else f"ended with exit code {exit_code}"
        super().__init__(f"rank {rank} {how}")
        self.rank, self.exit_code = rank, exit_code


# the signals (SIGTERM, SIGINT) this process received since it began handling them
_received: list[int] = []


def interrupt_on_signal(signum, frame):
    """A SIGTERM or SIGINT handler that unwinds like Ctrl-C (`KeyboardInterrupt`, "terminated" for SIGTERM):
    what a process staged is removed on the way out. Only the first signal raises: a second one, arriving while
    the first unwinds, would cut its clean-up short (a staging folder half removed). Each is noted
    (`interrupted`), so that one whose exception a library swallowed (a broad `except` around an import) still
    stops the command before it publishes anything."""
    first = not _received
    _received.append(signum)
    if first:
        raise KeyboardInterrupt("terminated" if signum == signal.SIGTERM else "")


def interrupted() -> bool:
    """Whether this process has received SIGTERM or SIGINT since it began handling them."""
    return bool(_received)


def check_not_interrupted() -> None:
    """Raise `KeyboardInterrupt` if a signal came, even one whose exception was swallowed: called before an
    output is published."""
    if _received:
        raise KeyboardInterrupt("terminated" if signal.SIGTERM in _received else "")


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Meanwhile SIGTERM and SIGINT are handled by `interrupt_on_signal` (in the main thread; elsewhere Python
    allows no handler and nothing changes), from a clean slate; the previous handlers come back after, and
    what was received is forgotten."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        for number in previous:
            signal.signal(number, interrupt_on_signal)
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _received.clear()
