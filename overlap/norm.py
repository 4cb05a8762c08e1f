"""The all-reduce, residual add and RMSNorm of a tensor-parallel decoder layer as one operation.

    y, r = fused_all_reduce_rmsnorm(x, residual, weight, eps=1e-6, group=None)
    # r = all_reduce(x) + residual;  y = rmsnorm(r) * weight   (reference_all_reduce_rmsnorm)

Design note. A row-parallel projection (attention's o, the MLP's down) ends in an all-reduce of
its partial sums, which the layer follows with the residual add and the next RMSNorm: at decode,
a few rows each, three launches that each cost more in latency than in bytes. Two strategies:

* ``fused``: one kernel (``norm.cu``) on the GPUs of one node. Each block pushes its rows of
  ``x`` into every peer's peer memory (``collectives.peer``), sums them in rank order, adds the
  residual, writes ``r``, reduces the row's sum of squares and writes ``y``: the all-reduce's
  bytes and nothing else cross the link, and ``r`` never makes a second trip through memory
  before the norm reads it. Messages within the low-latency words' area (256 KiB) travel as
  low-latency words, larger ones through the slots with one barrier; at one rank it is the add
  and the norm in one kernel. Every rank computes the same bits. Captured by CUDA graphs (the
  call number lives on the device), once an eager call has built the peer memory and the kernel.
* ``sequential``: ``collectives.all_reduce`` (``auto``'s algorithm), torch's add and
  ``torch.nn.functional.rms_norm``: every backend, Gloo included.

``auto`` runs ``fused`` wherever it can at decode sizes (at most ``DECODE_ROWS`` rows) and
``sequential`` elsewhere, and ``last_choice(group)`` says which and why. The kernel rounds ``r``
to the dtype once and computes the norm in float32 from the rounded ``r``; ``sequential``, like
the reference (the plain program, torch.distributed), rounds the all-reduce and the add
separately, so the two agree within the dtype's rounding, not bit for bit.

Gradients follow the tensor-parallel convention (``ops.py``): the results are the same on every
rank, so ``x``'s gradient is ``r``'s total gradient with no communication, as is ``residual``'s.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

import numpy as np
import torch
import torch.distributed as dist

import collectives as C
from collectives import _ops as _c_ops
from collectives._validate import _current_device
from collectives.dispatch import run_recorded
from collectives.errors import InvalidArgumentError, InvalidTypeError, UnsupportedError
from collectives.peer import DTYPES, _launch, has_peer_memory, peer_memory, peer_unavailable
from collectives.peer._layout import ONE_SHOT_LL_MAX_BYTES
from collectives.peer.memory import _CTX, _TAGS, PACK_BYTES, _all_gather_ints

from .ops import _LAST, OverlapChoice, _capturing

__all__ = ["fused_all_reduce_rmsnorm", "reference_all_reduce_rmsnorm", "NORM_STRATEGIES", "DECODE_ROWS"]

NORM_STRATEGIES = ("auto", "fused", "sequential")
DECODE_ROWS = 256  # auto's fused range: the decode batches (tokens) a layer sees
MAX_ROW_BYTES = 64 << 10  # the fused kernel's widest row (a block per row): hidden 32768 in bf16
SOURCE = Path(__file__).with_name("norm.cu")  # compiled after collectives/peer/peer.cuh
_OP = "all_reduce_rmsnorm"
_GRID = 1024  # the most blocks of the one-rank kernel (a block per row)


def reference_all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                                 group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = all_reduce(x) + residual; y = rms_norm(r) * weight``, with torch.distributed and torch."""
    s = x.clone()
    dist.all_reduce(s, group=group)
    r = s + residual
    return torch.nn.functional.rms_norm(r, (r.shape[-1],), weight, eps), r


# -- checks ----------------------------------------------------------------------------------------
def _check(x: Any, residual: Any, weight: Any, eps: Any, strategy: Any) -> None:
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(name, t, f"is a {type(t).__name__}, not a torch.Tensor", f"pass {name} as a tensor")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise InvalidArgumentError("x", x, f"has shape {tuple(x.shape)}; it needs a last (hidden) dimension of at "
                                   "least 1", "pass [..., hidden]")
    if residual.shape != x.shape:
        raise InvalidArgumentError("residual", residual, f"has shape {tuple(residual.shape)}, x {tuple(x.shape)}",
                                   "pass a residual of x's shape")
    if weight.shape != (x.shape[-1],):
        raise InvalidArgumentError("weight", weight, f"has shape {tuple(weight.shape)}; the norm's weight is "
                                   f"[{x.shape[-1]}] (x's last dimension)", f"pass a weight of shape [{x.shape[-1]}]")
    for name, t in (("residual", residual), ("weight", weight)):
        if t.dtype != x.dtype:
            raise InvalidArgumentError(name, t, f"has dtype {t.dtype} but x has {x.dtype}", "give all three one dtype")
        if t.device != x.device:
            raise InvalidArgumentError(name, t, f"is on {t.device} but x is on {x.device}", "put all three on one device")
    if not x.is_floating_point():
        raise InvalidArgumentError("x", x, f"has dtype {x.dtype}; the norm needs floating point", "pass float tensors")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps <= 3.4e38:
        raise InvalidArgumentError("eps", eps, "must be a float32 number >= 0", "pass the norm's epsilon, e.g. 1e-6")
    if strategy not in NORM_STRATEGIES:
        raise UnsupportedError("strategy", strategy, "is not a strategy of fused_all_reduce_rmsnorm",
                               f"pass one of {list(NORM_STRATEGIES)}")


# -- the fused kernel's plan -----------------------------------------------------------------------
def _unavailable(comm: C.Communicator, x: torch.Tensor) -> str:
    """Why the fused kernel cannot take ``x`` on this group, or ``""``; builds the group's peer
    memory where it can and has none yet (collective: every rank makes the same call)."""
    if x.device.type != "cuda":
        return f"it is a CUDA kernel; these tensors are on {x.device.type}"
    if x.dtype not in DTYPES:
        return f"it reduces {sorted(map(str, DTYPES))}, not {x.dtype}"
    if x.shape[-1] * x.element_size() > MAX_ROW_BYTES:
        return (f"rows of {x.shape[-1] * x.element_size()} B: one block takes a whole row, beyond "
                f"{MAX_ROW_BYTES} B a row needs more than a block")
    if _capturing() and not _ready(comm, x):
        return ("its peer memory or module does not exist and cannot be built while capturing: call the "
                "operator once before capturing")
    if comm.size == 1:
        return ""
    why = peer_unavailable(comm)
    if why:
        return f"peer memory: {why}"
    _compiled(comm, x.get_device())
    pm = peer_memory(comm)
    if not _words(x, pm) and x.numel() > _slot_elements(pm, x.element_size()):
        return (f"{x.numel() * x.element_size()} B do not fit one rank's share of a set of slots "
                f"({pm.set_bytes // pm.world} B; COMMOPS_PEER_BYTES sets it)")
    return ""


_COMPILED: set[int] = set()  # the devices this process has compiled norm.cu for


def _compiled(comm: C.Communicator, device: int) -> None:
    """Compile norm.cu for ``device`` on its first use, then line the ranks up on the host: a cold
    compile takes seconds, which the first call's peers would otherwise wait out inside the
    kernel's bounded waits on the GPU. Collective the first time (every rank's first fused call
    is the same call)."""
    if device in _COMPILED:
        return
    _launch.compile_module(device, "ar_rmsnorm_ll_f32_vec", SOURCE)
    _all_gather_ints(comm, [0])
    _COMPILED.add(device)


def _slot_elements(pm: Any, es: int) -> int:
    pack = PACK_BYTES // es
    return pm.set_bytes // es // pm.world // pack * pack  # type: ignore[no-any-return]


_EPS: dict[float, int] = {}  # eps -> its float32 bits, as the kernels take it


def _eps_bits(eps: float) -> int:
    bits = _EPS.get(eps)
    if bits is None:
        if len(_EPS) > 64:
            _EPS.clear()
        bits = _EPS[eps] = struct.unpack("<I", struct.pack("<f", eps))[0]
    return bits


_LOCAL: dict[tuple[int, str], Any] = {}  # the one-rank kernels, per (device, name)
_WARM: set[tuple[int, torch.dtype]] = set()  # (device, dtype) the fused kernels have run for: module loaded
_LOCAL_CTX = np.zeros((), dtype=_CTX).tobytes()  # (the one-rank kernel reads no context)


def _local_kernel(device: int, name: str) -> Any:
    k = _LOCAL.get((device, name))
    if k is None:
        k = _LOCAL[(device, name)] = _launch.Kernel(name, device, _LOCAL_CTX, 9, _launch.sources_of(SOURCE))
    return k


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % PACK_BYTES == 0 else t.clone()


def _words(x: torch.Tensor, pm: Any) -> bool:
    """Whether ``x`` (``[..., hidden]``) travels as low-latency words: the whole message within their
    area, rows of whole 4-byte words. By shape alone: every rank launches the same kernel."""
    es = x.element_size()
    return x.numel() * es <= min(pm.ll_max_bytes, ONE_SHOT_LL_MAX_BYTES) and x.shape[-1] * es % 4 == 0


class _Plan(NamedTuple):
    """A fused call's launch for one (shape, dtype, device, strategy) on one group, kept after
    its first launch: repeats (a decode loop) skip the choice and the kernel's lookup."""
    choice: OverlapChoice
    kernel: Any
    grid: int
    slot: int   # the stride between the ranks' shares of the peer buffers, in elements
    pm: Any     # the peer memory the kernel is bound to (None at one rank): the plan holds while it is open
    rows: int
    settings: tuple[int, int]  # the memory's (max_blocks, ll_max_bytes) it was made under (tune_peer sets them)


_PLANS: WeakKeyDictionary[C.Communicator, dict[tuple[Any, ...], _Plan]] = WeakKeyDictionary()
_PLANS_MAX = 256  # shapes per group before the table starts again


def _plan(comm: C.Communicator, x: torch.Tensor, choice: OverlapChoice) -> _Plan:
    """The launch for ``x`` (``[..., hidden]``, 16-byte aligned) on this group."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    es = x.element_size()
    vec = hidden % (PACK_BYTES // es) == 0
    if comm.size == 1:
        k = _local_kernel(x.get_device(), f"add_rmsnorm_{_TAGS[x.dtype]}_{'vec' if vec else 'scalar'}")
        return _Plan(choice, k, max(1, min(rows, _GRID)), 0, None, rows, (0, 0))
    pm = peer_memory(comm)
    grid = max(1, min(rows, pm.max_blocks))
    settings = (pm.max_blocks, pm.ll_max_bytes)
    if _words(x, pm):  # each rank's words ONE_SHOT_LL_MAX_BYTES // 4 apart (_layout.ll_set_bytes)
        k = pm.kernel("ar_rmsnorm_ll", x.dtype, True, 9, source=SOURCE)
        return _Plan(choice, k, grid, ONE_SHOT_LL_MAX_BYTES // 4, pm, rows, settings)
    return _Plan(choice, pm.kernel("ar_rmsnorm", x.dtype, vec, 9, source=SOURCE), grid, _slot_elements(pm, es), pm,
                 rows, settings)


def _kept_plan(comm: C.Communicator, x: torch.Tensor, strategy: str) -> _Plan | None:
    """The plan an earlier fused call of this shape left, where it still holds."""
    plans = _PLANS.get(comm)
    if plans is None or not x.is_cuda:
        return None
    plan = plans.get((x.shape, x.dtype, x.get_device(), strategy))
    if plan is None or x.get_device() != _current_device():
        return None
    pm = plan.pm
    if pm is not None:
        if pm is not comm._peer_memory or pm.closed or plan.settings != (pm.max_blocks, pm.ll_max_bytes):
            return None
        if pm._err_np[0]:  # a kernel of this memory reported a timeout: raise it, as pm.kernel does
            pm.check()
    return plan


def _fused(comm: C.Communicator, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
           strategy: str, plan: _Plan | OverlapChoice) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel, following ``plan`` (a kept one), or a new plan for ``choice``, kept after its launch."""
    # Every input 16-byte aligned (a view into a larger buffer is copied): the kernel's member then
    # follows from the shape alone, the same on every rank, and so do its sums' order and bits.
    x2, res2, w = _aligned(x), _aligned(residual), _aligned(weight)
    y, r = torch.empty_like(x2), torch.empty_like(x2)
    if x2.numel() == 0:
        return y, r
    kept = isinstance(plan, _Plan)
    if not isinstance(plan, _Plan):
        plan = _plan(comm, x2, plan)
    stream = _launch.current_stream(x2.get_device())
    # a call of the group, in the flight recorder
    run_recorded(comm, _OP, "fused", r, x2, plan.kernel, plan.grid, stream, x2.data_ptr(), res2.data_ptr(),
                 w.data_ptr(), y.data_ptr(), r.data_ptr(), plan.rows, x2.shape[-1], _eps_bits(eps), plan.slot)
    if not kept:
        _WARM.add((x2.get_device(), x2.dtype))
        plans = _PLANS.setdefault(comm, {})
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[(x.shape, x.dtype, x.get_device(), strategy)] = plan
    return y, r


def _sequential(comm: C.Communicator, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.contiguous().clone()
    if comm.size > 1:
        C.all_reduce(s, group=comm.group)
    r = s.add_(residual)
    return torch.nn.functional.rms_norm(r, (r.shape[-1],), weight, eps), r


def _ready(comm: C.Communicator, x: torch.Tensor) -> bool:
    """Whether a capture can launch the fused kernel for ``x``: its peer memory and module exist."""
    return (x.get_device(), x.dtype) in _WARM and (comm.size == 1 or has_peer_memory(comm))


def _choose(comm: C.Communicator, x: torch.Tensor, strategy: str) -> OverlapChoice:
    rows = x.numel() // x.shape[-1]
    if strategy == "sequential":
        return OverlapChoice(_OP, "sequential", 1, "requested by the caller")
    if x.is_cuda and x.get_device() != _current_device():
        # refused, not a fallback: a rank that ran the sequence while its peers run the kernel would hang them
        raise InvalidArgumentError("x", x, f"is on {x.device} but the current CUDA device is "
                                   f"cuda:{_current_device()}, where peer memory and the launches are",
                                   f"call torch.cuda.set_device({x.get_device()}) first")
    if strategy == "fused":
        why = _unavailable(comm, x)
        if why:
            raise UnsupportedError("strategy", strategy, f"cannot run here: {why}", "use 'auto' or 'sequential'")
        return OverlapChoice(_OP, "fused", 1, "requested by the caller")
    if rows > DECODE_ROWS:
        return OverlapChoice(_OP, "sequential", 1, f"{rows} rows: beyond the fused kernel's decode range "
                             f"(<= {DECODE_ROWS} rows), where the three steps' launches are not what costs")
    why = _unavailable(comm, x)
    if why:
        return OverlapChoice(_OP, "sequential", 1, f"the fused kernel cannot run: {why}")
    return OverlapChoice(_OP, "fused", 1, f"{rows} rows at decode size: one kernel for the all-reduce, the add and "
                         "the norm")


def _all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: Any,
                        strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The primitive (see ``fused_all_reduce_rmsnorm``), without autograd."""
    comm = C.get_communicator(group)
    plan = _kept_plan(comm, x, strategy) if strategy != "sequential" else None
    if plan is not None:
        _LAST[comm] = plan.choice
        return _fused(comm, x, residual, weight, float(eps), strategy, plan)
    choice = _LAST[comm] = _choose(comm, x, strategy)
    if choice.strategy == "fused":
        return _fused(comm, x, residual, weight, float(eps), strategy, choice)
    return _sequential(comm, x, residual, weight, float(eps))


# -- the op and its gradient -----------------------------------------------------------------------
_LIB = torch.library.Library("commops", "FRAGMENT")
SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps, str group, str strategy) -> (Tensor, Tensor)"


def _op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: str,
        strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    y, r = _all_reduce_rmsnorm(x, residual, weight, eps, _c_ops.communicator(group).group, strategy)
    return y.contiguous(), r.contiguous()


def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: str,
          strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.eps = inputs[3]
    ctx.save_for_backward(output[1], inputs[2])


def _backward(ctx: Any, gy: torch.Tensor | None, gr: torch.Tensor | None) -> Any:
    r, w = ctx.saved_tensors
    acc = torch.promote_types(r.dtype, torch.float32)  # float32 for the 16-bit types, as the forward
    rf = r.to(acc)
    inv = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    n = rf * inv
    g = torch.zeros_like(rf) if gr is None else gr.to(acc)
    gw = None
    if gy is not None:
        gn = gy.to(acc) * w.to(acc)
        g = g + inv * (gn - n * (gn * n).mean(-1, keepdim=True))
        gw = (gy.to(acc) * n).reshape(-1, r.shape[-1]).sum(0).to(w.dtype) if ctx.needs_input_grad[2] else None
    g = g.to(r.dtype)
    return (g if ctx.needs_input_grad[0] else None), (g if ctx.needs_input_grad[1] else None), gw, None, None, None


def _register() -> None:
    if _c_ops.defined(_OP):  # this module imported again (its first copy's op serves)
        return
    _LIB.define(_OP + SCHEMA)
    _LIB.impl(_OP, _op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"commops::{_OP}", _fake, lib=_LIB)
    torch.library.register_autograd(f"commops::{_OP}", _backward, setup_context=_setup, lib=_LIB)


_register()

_compiling = torch.compiler.is_compiling


def fused_all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                             group: Any = None, *, strategy: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``r = all_reduce(x) + residual; y = rms_norm(r) * weight`` (``reference_all_reduce_rmsnorm``).

    Args:
        x: ``[..., hidden]``, this rank's partial sums (a row-parallel projection's output before
            its all-reduce).
        residual: ``x``'s shape, dtype and device: the residual stream, the same on every rank.
        weight: ``[hidden]``, the norm's weight.
        eps: added to the mean square before its inverse square root.
        group: the process group (default: world); every rank passes the same shapes and dtype.
        strategy: "auto", "fused" (one kernel over peer memory; raises ``UnsupportedError``
            naming why where it cannot run) or "sequential" (our all-reduce, torch's add and
            ``rms_norm``; every backend).
    Returns:
        ``(y, r)``, new contiguous tensors of ``x``'s shape, the same on every rank: the normed
        rows and the residual stream after the add. The op ``torch.ops.commops.all_reduce_rmsnorm``,
        differentiable (the gradient needs no communication).
    """
    _check(x, residual, weight, eps, strategy)
    if not _compiling() and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                                               or weight.requires_grad)):
        return _all_reduce_rmsnorm(x, residual, weight, eps, group, strategy)
    return torch.ops.commops.all_reduce_rmsnorm(x, residual, weight, float(eps), _c_ops.group_name(group), strategy)
