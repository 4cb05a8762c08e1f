"""``init()``: start torch.distributed from whatever launched this process.

Supported launchers:

- ``torchrun`` (and anything else that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT``, e.g. a c10d rendezvous across nodes): ``env://`` initialisation.
- ``mpiexec``/``mpirun`` (MPICH, Open MPI, Intel MPI, MVAPICH, Slurm's PMI): rank, size and local
  rank come from MPI through mpi4py; rank 0 opens a ``TCPStore`` on a free port and sends its
  address over MPI, so no port is fixed in advance and no race on a free port exists.

The backend follows the device: CUDA -> ``nccl``, Ascend NPU (``torch_npu`` importable and a device
present) -> ``hccl``, otherwise ``gloo``; an explicit ``backend=`` wins. HCCL selection is written
and unit-tested, but has never run on Ascend hardware.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from . import _env
from ._launcher import LaunchInfo, launcher_environment
from .communicator import Communicator, get_communicator
from .errors import InvalidArgumentError, LaunchError
from .recorder import set_trace_dir

__all__ = ["init", "LaunchInfo", "launcher_environment", "select_backend"]

_HOW_TO_LAUNCH = (
    "start the script with a launcher: `torchrun --nproc-per-node N script.py` (one node), "
    "`torchrun --nnodes M --node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...` (several nodes), "
    "or `mpiexec -n N python script.py`; or call torch.distributed.init_process_group yourself"
)
def select_backend(backend: str | None, *, cuda: bool, npu: bool, mpi_available: bool = False) -> str:
    """The backend ``init`` uses: an explicit one if given, else by device (cuda > npu > cpu)."""
    if backend is not None:
        name = backend.lower()
        if name == "mpi" and not mpi_available:
            raise InvalidArgumentError(
                "backend", backend, "this torch build has no MPI backend (torch.distributed.is_mpi_available() is False)",
                "use backend='gloo' under mpiexec (commops takes rank and size from MPI), or a torch built with MPI",
            )
        return name
    if cuda:
        return "nccl"
    if npu:
        return "hccl"
    return "gloo"


def _npu_present() -> bool:
    try:
        # deferred: optional and heavy, Ascend hosts only (importing it registers torch.npu)
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def _from_mpi() -> tuple[LaunchInfo, dist.Store]:
    try:
        from mpi4py import MPI  # deferred: optional (commops[mpi]), and importing it initialises MPI
    except ImportError as exc:
        raise LaunchError(f"started by an MPI launcher but mpi4py is missing: pip install 'commops[mpi]' ({exc})") from exc
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    same_host = local_size == size
    if rank == 0:
        addr = _env.MPI_MASTER_ADDR.get() or ("127.0.0.1" if same_host else socket.gethostname())
        # wait_for_workers=False: the others learn the port only from the broadcast below.
        store = dist.TCPStore(addr, 0, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        world.bcast((addr, store.port), root=0)
    else:
        addr, port = world.bcast(None, root=0)
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=datetime.timedelta(seconds=300))
    return LaunchInfo("mpi", rank, size, local_rank, local_size), store


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None, *,
         trace_dir: str | None = None, debug: bool | None = None) -> Communicator:
    """Initialise torch.distributed from the launcher's environment and return the world communicator.

    Idempotent: if torch.distributed is already initialised (by an earlier call or by the caller's
    own ``init_process_group``), returns the communicator of the existing default group.

    Args:
        backend: "nccl", "gloo", "mpi", "hccl" (or torch's "cpu:gloo,cuda:nccl" form); ``None``
            picks by device: CUDA -> nccl, Ascend NPU -> hccl, else gloo.
        timeout: seconds (or a timedelta) every collective of the default group may take.
        trace_dir: where the flight recorder dumps (``COMMOPS_TRACE_DIR`` by default); also
            installs its SIGUSR1 / SIGTERM handlers (``collectives/recorder.py``).
        debug: debug check mode for the world communicator (``COMMOPS_DEBUG`` by default;
            ``collectives/debug.py``).
    Raises:
        LaunchError: not started by torchrun or an MPI launcher.
    """
    if trace_dir or _env.TRACE_DIR.get():
        set_trace_dir(trace_dir or _env.TRACE_DIR.get())
    if dist.is_initialized():
        return _with_debug(get_communicator(), debug)
    info = launcher_environment()
    if info is None:
        raise LaunchError(f"no launcher found (no RANK/WORLD_SIZE/MASTER_ADDR, no MPI variables): {_HOW_TO_LAUNCH}")
    store = None
    if info.launcher == "mpi":
        info, store = _from_mpi()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    name = select_backend(backend, cuda=cuda, npu=False if cuda else _npu_present(),
                          mpi_available=dist.is_mpi_available())
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if "nccl" in name and cuda:
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    elif "hccl" in name:
        torch.npu.set_device(info.local_rank % torch.npu.device_count())  # type: ignore[attr-defined]
    if store is not None:
        dist.init_process_group(name, store=store, rank=info.rank, world_size=info.world_size, **kwargs)
    else:
        dist.init_process_group(name, init_method="env://", **kwargs)
    comm = get_communicator()
    if "timeout" in kwargs:
        comm.timeout_s = kwargs["timeout"].total_seconds()  # also bounds the peer-memory kernels' waits
    return _with_debug(comm, debug)


def _with_debug(comm: Communicator, debug: bool | None) -> Communicator:
    if debug is not None:
        comm.debug = debug
    return comm
