"""torch.distributed + Megatron parallel state, on CPU (gloo) or GPU (nccl), brought up and torn down.

    with modelzoo.runtime.parallel(tp=2):        # inside each of 2 processes (torchrun, or spawn())
        model = provider.provide()

A single process needs no launcher: `parallel()` with world size 1 starts a one-rank group itself.
`spawn(fn, world_size)` runs `fn(rank, *args)` in that many fresh processes with a real gloo group,
which is how the tests and the CLI exercise tensor parallelism on a CPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import datetime
import io
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from modelzoo import compat
from modelzoo.processes import RankDied, RankFailed, check_not_interrupted, exception_kinds, interrupt_on_signal


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def check(self, world_size: int) -> None:
        for name, size in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp)):
            if size < 1:
                raise ValueError(f"parallel layout: {name}={size} must be >= 1")
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"parallel layout: world size {world_size} is not divisible by tp*pp = {self.model_parallel_size}"
            )
        # context parallelism splits the data-parallel replicas of each (tensor x pipeline) shard
        if world_size % (self.model_parallel_size * self.cp):
            raise ValueError(
                f"parallel layout: world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.model_parallel_size * self.cp}"
            )
        # expert parallelism splits the data-parallel replicas of each (tensor x pipeline) shard
        if world_size % (self.model_parallel_size * self.ep):
            raise ValueError(
                f"parallel layout: world size {world_size} is not divisible by tp*pp*ep = "
                f"{self.model_parallel_size * self.ep}"
            )


def device() -> torch.device:
    """The device models are built on: the local GPU under nccl, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, seed: int = 1234) -> Iterator[ParallelLayout]:
    """Bring up torch.distributed (if needed) and Megatron's parallel state; tear both down on exit.

    A process group that already exists (torchrun, a trainer) is used and left alone on exit.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    compat.apply()
    layout = ParallelLayout(tp, pp, ep, cp)
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        _init_single_process_group()
    try:
        layout.check(dist.get_world_size())
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        yield layout
    finally:
        parallel_state.destroy_model_parallel()
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _init_single_process_group() -> None:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group(backend=_backend(), timeout=datetime.timedelta(minutes=10))
        return
    dist.init_process_group(
        backend=_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(rank, *args)` on `world_size` ranks: in this process when that is one, else via `spawn`."""
    if world_size == 1:
        return [fn(0, *args)]
    return spawn(fn, world_size, *args)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run `fn(rank, *args)` in `world_size` fresh processes joined in one process group.

    Returns each rank's return value: tensors, numbers, strings and containers of them (it travels
    through `torch.save` and comes back through `torch.load(weights_only=True)`). An exception on any
    rank is raised here as `RankFailed`, with that rank's traceback.
    """
    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args, os.getpid()), daemon=False)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    returned: dict[int, Any] = {}
    try:
        while len(returned) < world_size:
            check_not_interrupted()  # a signal whose exception was swallowed still stops the ranks
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue.Empty:
                _raise_if_one_died(processes, returned)
                continue
            if not ok:  # the other ranks may be waiting on a collective with it: stop them all
                _raise_if_one_died(processes, returned)  # a rank killed is why the others fail: it is named
                raise RankFailed(rank, *value)
            returned[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for process in processes:
            if len(returned) < world_size:
                process.kill()
            process.join()
    return [returned[rank] for rank in range(world_size)]


def _raise_if_one_died(processes: list, returned: dict[int, Any]) -> None:
    """`RankDied` for the first rank that ended without reporting (its exception or its result): killed."""
    dead = [rank for rank, process in enumerate(processes) if process.exitcode not in (None, 0) and rank not in returned]
    if dead:
        raise RankDied(dead[0], processes[dead[0]].exitcode) from None


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent(parent: int) -> None:
    """End this process when `parent` ends, however it ends (SIGKILL included): a rank left alone would go on
    and could publish its output after the command was killed. Linux's parent-death signal does it; a
    thread watching the parent is the fallback elsewhere. Either way a parent already gone ends it now."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        watched_by_kernel = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        watched_by_kernel = False
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)
    if not watched_by_kernel:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _rank_main(fn, rank: int, world_size: int, port: int, results, args, parent: int) -> None:
    _die_with_parent(parent)
    for number in (signal.SIGTERM, signal.SIGINT):  # the first unwinds like Ctrl-C, later ones do not cut it short
        signal.signal(number, interrupt_on_signal)
    # tqdm's default lock is a multiprocessing semaphore, which a rank killed mid-run leaves to the resource
    # tracker (a warning at exit); the ranks' bars need no lock across processes
    tqdm.set_lock(threading.RLock())
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # two CPU ranks on a two-core machine: one thread each keeps them from fighting over cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group(backend=_backend(), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=10))
        value = fn(rank, *args)
        # as bytes: a tensor put on a queue travels as a file descriptor of this process, which is
        # gone if the process exits before the parent reads it
        serialized = io.BytesIO()
        torch.save(value, serialized)
        results.put((rank, True, serialized.getvalue()))
    except BaseException as error:  # noqa: BLE001 - the error travels to the parent
        results.put((rank, False, (type(error).__name__, str(error), traceback.format_exc(), exception_kinds(error),
                                   getattr(error, "filename", None))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
