"""What a command's processes share that needs no torch: the exception that reports a failed rank and the
SIGTERM handler that unwinds like Ctrl-C. Apart from runtime.py (torch.distributed) so that the command line
installs and names them before it knows whether the command needs torch."""


class RankFailed(RuntimeError):
    """An exception on one rank of `spawn`; `error_type` and `message` are the original's."""

    def __init__(self, rank: int, error_type: str, message: str, remote_traceback: str):
        super().__init__(f"rank {rank} failed with {error_type}: {message}\n{remote_traceback}")
        self.rank, self.error_type, self.message, self.remote_traceback = rank, error_type, message, remote_traceback


def interrupt_on_sigterm(signum, frame):
    """A SIGTERM handler that unwinds like Ctrl-C (`KeyboardInterrupt("terminated")`): what a process
    staged is removed on the way out."""
    raise KeyboardInterrupt("terminated")
