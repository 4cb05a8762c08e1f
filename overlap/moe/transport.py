"""The contract every MoE transport fills, and the one registry that names the transports.

Design note. A transport moves the rows of an expert-parallel dispatch to the experts' ranks and
brings the experts' results back. ``MoEDispatcher`` does everything around that: it checks each
call's shapes, runs the shared flow (dispatch, experts, combine; the chunks of a pipelined
forward), and holds the autograd Functions, which call the transport's forward and backward
halves. It never asks which transport it holds: it used to test the transport's name in a dozen
places and to carry the transport's state in a dict read by string keys, and adding a transport
meant some twenty edits in seven files. Now a transport is one module (``nccl.py``, ``peer.py``)
holding a subclass of :class:`Transport`, its options (a frozen dataclass deriving from
:class:`TransportOptions`) and its states (frozen dataclasses deriving from
``handles.TransportState``), and one line in ``overlap/moe/__init__.py`` registers it by name
(:func:`register_transport`).

What the contract asks, in the order of a call (every method that communicates is collective
over the dispatcher's group: every rank calls it, in the same order, with the same options and
bounds; token counts may differ between ranks, and may be zero)::

    check_tokens(x)                          refuse what cannot run here, before anything is sent
    route(topk_idx, bounds) -> handles       plan each token range (the counts exchange)
    dispatch(x, topk_idx) -> recv_x, handle  route, then dispatch_rows (or both in one go)
    dispatch_rows(x, handle) -> recv_x       rows to the experts' ranks, grouped by local expert
    dispatch_packed(bytes, topk_idx)         rows of raw bytes (the FP8 dispatch), where packed_rows
    combine(rows, weights, handle) -> out    each token's weighted sum of its returned rows
    dispatch_backward / combine_backward     the adjoints, which autograd runs
    dispatch_low_latency / combine_low_latency / check_routing   where offers_low_latency
    pipeline / routes_ahead / auto_chunks / pipeline_by_source   the pipelined forward
    close()                                  release buffers (collective)

Shapes, for a group of ``W`` ranks and ``E`` experts (``E/W`` local ones): ``x [tokens, hidden]``
of the dispatcher's dtype; ``topk_idx [tokens, k]`` integer expert ids; ``weights [tokens, k]``;
``recv_x [received pairs, hidden]``, grouped by local expert, then source rank, then token (the
layout ``GroupedSwiGLU`` takes); ``rows`` (the experts' output) in ``recv_x``'s layout. Nothing
writes its inputs in place. Work is issued on the caller's current stream; a transport that uses
side streams or copy engines orders them after the caller's work so far and makes the caller's
stream wait for them before it returns.

The old per-transport keyword arguments of ``MoEDispatcher`` (``max_tokens``, ``top_k``,
``routing``, ``exchange_pieces``, ``pipeline_transfers``) still work: they are collected in a
:class:`TransportArguments`, checked as before, and each options class maps them
(``from_arguments``) and back (``arguments``).

Tried and rejected: a ``Protocol`` (the contract has defaults that most transports share: the
host routing's ``dispatch``, no low-latency pair, no pipeline of its own; a base class states
them once); passing the dispatcher to its transport (the transport would then reach into the
dispatcher; :class:`TransportSetup` says what it may know).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import collectives as C
from collectives.errors import InvalidArgumentError, UnsupportedError

from .handles import DispatchHandle, LowLatencyHandle

__all__ = ["Transport", "TransportSetup", "TransportOptions", "NoOptions", "TransportArguments", "CombineGrads",
           "Experts", "TransportSpec", "register_transport", "unregister_transport", "registered_transports",
           "low_latency_transports", "transport_spec", "resolve_transport"]

# What runs a rank's experts: rows in recv_x's layout and the rows per local expert -> their outputs
Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]

_ROUTINGS = ("auto", "host", "device")
_TRANSFERS = ("auto", "copy_engine", "sm")


@dataclass(frozen=True)
class TransportSetup:
    """What a dispatcher tells the transport it builds: the group and the experts' layout.

    Attributes:
        comm: the expert-parallel group's communicator (``collectives.get_communicator(group)``).
        group: the group itself (what the verbs take as ``group=``).
        num_experts: ``E``; rank r owns experts ``r*E/W ... (r+1)*E/W - 1``.
        hidden: the tokens' width.
        dtype, device: of the tokens, where the dispatcher was told (else ``None``).
        capacity_factor: ``None`` (dropless) or each expert's capacity factor per rank.
    """

    comm: C.Communicator
    group: Any
    num_experts: int
    hidden: int
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    capacity_factor: float | None = None

    @property
    def local_experts(self) -> int:
        """``E/W``: the experts of each rank."""
        return self.num_experts // self.comm.size

    @property
    def first_expert(self) -> int:
        """This rank's first expert."""
        return self.comm.rank * self.local_experts


@dataclass(frozen=True)
class TransportArguments:
    """``MoEDispatcher``'s keyword arguments that belong to one transport or another, as a caller
    passed them (``None``: not passed). Building one checks each value that was passed, as the
    dispatcher always did, whatever the transport.

    Attributes:
        max_tokens, top_k: transport "peer": the most tokens of one dispatch, the k of every routing.
        routing: transport "nccl": "auto", "host" or "device".
        exchange_pieces: transport "nccl": a positive int.
        pipeline_transfers: transport "peer": "auto", "copy_engine" or "sm".
    """

    max_tokens: int | None = None
    top_k: int | None = None
    routing: str | None = None
    exchange_pieces: int | None = None
    pipeline_transfers: str | None = None

    def __post_init__(self) -> None:
        p = self.exchange_pieces
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise InvalidArgumentError("exchange_pieces", p, "is not a positive int", "pass 1 (or e.g. 4)")
        if self.routing is not None and self.routing not in _ROUTINGS:
            raise InvalidArgumentError("routing", self.routing, "is not 'auto', 'host' or 'device'", "pass 'auto'")
        if self.pipeline_transfers is not None and self.pipeline_transfers not in _TRANSFERS:
            raise InvalidArgumentError("pipeline_transfers", self.pipeline_transfers,
                                       "is not 'auto', 'copy_engine' or 'sm'", "pass 'auto'")

    def given(self) -> list[tuple[str, Any]]:
        """(name, value) of each argument that was passed."""
        return [(name, getattr(self, name)) for name in ("max_tokens", "top_k", "routing", "exchange_pieces",
                                                         "pipeline_transfers") if getattr(self, name) is not None]


class TransportOptions:
    """Base of the transports' options: a frozen dataclass per transport, checked when built.

    A subclass maps the dispatcher's old keyword arguments to itself (:meth:`from_arguments`,
    raising the typed errors those arguments always raised) and back (:meth:`arguments`, for
    the dispatcher's attributes of the same names). The defaults here take none of them.
    """

    @classmethod
    def from_arguments(cls, args: TransportArguments) -> TransportOptions:
        """The options that ``MoEDispatcher(..., transport=<name>, **args)`` asks for."""
        return cls()

    def arguments(self) -> TransportArguments:
        """These options as the dispatcher's old keyword arguments (``None`` where they have none)."""
        return TransportArguments()


@dataclass(frozen=True)
class NoOptions(TransportOptions):
    """The options of a transport that has none (it ignores the old keyword arguments)."""


@dataclass(frozen=True)
class CombineGrads:
    """What ``Transport.combine_backward`` is asked for.

    Attributes:
        rows: whether the experts' rows need their gradient.
        weights: whether the router weights need theirs (the same on every rank).
        weights_shape, weights_dtype: of the weights combine took (``[tokens, k]``).
    """

    rows: bool
    weights: bool
    weights_shape: tuple[int, ...]
    weights_dtype: torch.dtype


class Transport(ABC):
    """How one dispatcher's rows travel (see the module's design note for the call order and
    the shapes every method takes).

    Built once per dispatcher by its registered factory, ``factory(setup, options)``; buffers
    may be built on first use (then collectively) and are released by :meth:`close`.

    Args:
        setup: the dispatcher's group and experts.
        options: this transport's options (an instance of its registered options class).

    Attributes:
        setup: as given.
        options: as given; the dispatcher replaces it between calls (every rank alike) when a
            caller sets one of its old attributes (``dispatcher.pipeline_transfers = "sm"``).
        last_routing: (where, why) this transport last worked a routing out, if it chooses.
        last_pipeline: (how, why) its last pipelined forward moved rows, if it chooses.
        offers_low_latency: whether it implements the low-latency pair (class attribute); the
            dispatcher refuses the pair with ``UnsupportedError`` where it does not.
        packed_rows: whether :meth:`dispatch_packed` moves rows of raw bytes no wider than the
            tokens' rows (class attribute), as the FP8 dispatch's packed rows need (``fp8.py``).
    """

    offers_low_latency: ClassVar[bool] = False
    packed_rows: ClassVar[bool] = False

    def __init__(self, setup: TransportSetup, options: Any) -> None:
        self.setup = setup
        self.options = options
        self.last_routing: tuple[str, str] | None = None
        self.last_pipeline: tuple[str, str] | None = None

    @property
    def comm(self) -> C.Communicator:
        return self.setup.comm

    @property
    def group(self) -> Any:
        return self.setup.group

    # -- the exchange ------------------------------------------------------------------------------
    def check_tokens(self, x: torch.Tensor) -> None:
        """Raise a typed error if this transport cannot move ``x [tokens, hidden]`` here (the
        dispatcher has checked its shape, dtype and device). Called before every dispatch and
        pipelined forward, before anything is sent; the same answer on every rank. Default:
        nothing to refuse."""

    def routes_on_device(self, topk_idx: torch.Tensor) -> bool:
        """Whether ``dispatch`` works the routing of ``topk_idx`` out on the ids' device rather
        than on the host (a transport that chooses records why in ``last_routing``). Default:
        on the host."""
        return False

    @abstractmethod
    def route(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """One handle per token range ``(lo, hi)`` of ``bounds`` (ranges of ``topk_idx
        [tokens, k]``, in order; the same number on every rank), with one exchange of every
        range's counts. Collective. Bad ids (out of ``0..E-1``, or an expert twice for one token)
        raise ``InvalidArgumentError`` on every rank, naming the rank, before any row moves.
        Each handle's ``state`` is one of this transport's own (or ``None``)."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
        """``recv_x`` and its handle for ``x [tokens, hidden]`` and ``topk_idx [tokens, k]``.
        Collective. Default: :meth:`route` of the whole batch, then :meth:`dispatch_rows`. A
        transport that works the routing out within its row exchange overrides this and
        :meth:`routes_ahead`. Autograd is the dispatcher's (``dispatch_backward``)."""
        handle = self.route(topk_idx, [(0, topk_idx.shape[0])])[0]
        return self.dispatch_rows(x, handle), handle

    def dispatch_packed(self, packed: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
        """Received rows and the handle, as :meth:`dispatch`'s, for ``packed [tokens, width]``
        (uint8, contiguous; ``width`` at most the tokens' row bytes, and a transport may ask for
        whole 4-byte words, as the FP8 rows are): each token's row of raw bytes routed as
        ``topk_idx`` routes the token. Collective; only where :attr:`packed_rows`.
        Default: :meth:`route`, then :meth:`dispatch_rows` of the bytes (a transport whose
        ``dispatch_rows`` moves rows of any width and dtype)."""
        handle = self.route(topk_idx, [(0, topk_idx.shape[0])])[0]
        return self.dispatch_rows(packed, handle), handle

    @abstractmethod
    def dispatch_rows(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``recv_x [sum(handle.tokens_per_expert), hidden]``: each kept pair's token of ``x
        [handle.num_tokens, hidden]`` at its expert's rank, grouped by local expert. Collective."""

    @abstractmethod
    def dispatch_backward(self, grad_recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``grad_x [handle.num_tokens, hidden]`` from ``grad_recv`` (contiguous, ``recv_x``'s
        layout): each token's sum of its rows' gradients, a combine with unit weights.
        Collective (autograd runs it on every rank)."""

    @abstractmethod
    def combine(self, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, weights_grad: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """``out [handle.num_tokens, hidden]``, ``out[t] = sum_j weights[t, j] * rows[row of (t, j)]``
        (dropped pairs add nothing), and the tensors its backward pass needs (autograd saves
        them; ``combine_backward`` gets them back in order). ``rows`` in ``recv_x``'s layout;
        ``weights [num_tokens, k]``. ``weights_grad``: whether the weights will need a gradient
        (then what is saved must give it); the same on every rank. Collective."""

    @abstractmethod
    def combine_backward(self, grad_out: torch.Tensor, handle: DispatchHandle,
                         saved: tuple[torch.Tensor | None, ...], wanted: CombineGrads
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the rows' gradient in ``recv_x``'s layout, the weights' ``[tokens, k]`` of
        ``wanted.weights_dtype``) for ``grad_out [num_tokens, hidden]``, each ``None`` where
        ``wanted`` does not ask for it (a transport may return the rows' anyway). ``saved``:
        what :meth:`combine` returned. Collective."""

    # -- the low-latency pair (decode: nothing waits for the host; CUDA graphs) ------------------
    def dispatch_low_latency(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, LowLatencyHandle]:
        """``recv_x [E/W, capacity, hidden]`` (each local expert's rows first in its block) and
        its handle, without waiting for the host; no autograd, dropless (the dispatcher checks
        both). Only where ``offers_low_latency``. Collective."""
        raise self._no_low_latency()

    def combine_low_latency(self, expert_out: torch.Tensor, handle: LowLatencyHandle,
                            weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]`` from ``expert_out [E/W, capacity, hidden]``, reading only each
        block's first ``tokens_per_expert`` rows. Collective."""
        raise self._no_low_latency()

    def low_latency_capacity(self) -> int:
        """Rows per local expert block of ``dispatch_low_latency`` (the same for every call: what
        the traced op's shape says before it runs). Only where ``offers_low_latency``."""
        raise self._no_low_latency()

    def check_routing(self, handle: LowLatencyHandle, topk_idx: torch.Tensor) -> None:
        """Raise ``InvalidArgumentError`` on every rank if any rank's ids in this low-latency
        dispatch were bad (waits for the dispatch)."""
        raise self._no_low_latency()

    def _no_low_latency(self) -> UnsupportedError:
        return UnsupportedError("transport", type(self).__name__, "has no low-latency pair (offers_low_latency is "
                                "False)", "use dispatch() and combine()")

    # -- the pipelined forward ---------------------------------------------------------------------
    def pipeline(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                 bounds: list[tuple[int, int]]) -> torch.Tensor | None:
        """This transport's own pipelined forward, without autograd: dispatch, ``experts`` and
        combine over the token ranges ``bounds`` (at least two; the same number on every rank),
        a range's exchanges overlapping its neighbours' experts; ``out [tokens, hidden]``.
        ``None`` where it has none for this call: the dispatcher then runs the ranges one
        after another (:meth:`routes_ahead`). Default: ``None``."""
        return None

    def routes_ahead(self, topk_idx: torch.Tensor) -> bool:
        """Whether a forward in token ranges that runs them one after another (with autograd, or
        where :meth:`pipeline` has none) routes every range in one :meth:`route` first and sends
        range i+1's rows (:meth:`dispatch_rows`) before the experts take range i; else each
        range runs :meth:`dispatch` (routing included), the experts and combine in turn.
        Default: routes ahead (``dispatch`` is ``route`` and ``dispatch_rows``)."""
        return True

    def auto_chunks(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> tuple[int | str, str]:
        """``forward_pipelined(chunks="auto")`` without autograd: (chunks or "sources", why), the
        same on every rank (so from settings every rank shares, never from its token count).
        Default: one chunk."""
        return 1, "one chunk: this transport follows no tuned table"

    def pipeline_by_source_missing(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> str:
        """What :meth:`pipeline_by_source` needs that this call lacks, or ``""`` (the same on
        every rank). Default: the transport that has one."""
        return ("transport='peer' with pipeline_transfers='copy_engine' (the pipeline by source rank is the peer "
                f"transport's; this dispatcher's, {type(self).__name__}, has none)")

    def pipeline_by_source(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           experts: Experts) -> torch.Tensor:
        """``forward_pipelined(chunks="sources")``: the forward pipelined by source rank, without
        autograd, where :meth:`pipeline_by_source_missing` found nothing missing."""
        raise UnsupportedError("chunks", "sources", f"needs {self.pipeline_by_source_missing(x, topk_idx, experts)}",
                               "use chunks='auto' or an int")

    def close(self) -> None:
        """Release this transport's buffers, if any (collective); it can be used again after."""


@dataclass(frozen=True)
class TransportSpec:
    """One registered transport: its name, what builds it, and its options class."""

    name: str
    factory: Callable[[TransportSetup, Any], Transport]
    options: type[TransportOptions]


_TRANSPORTS: dict[str, TransportSpec] = {}


def register_transport(name: str, factory: Callable[[TransportSetup, Any], Transport],
                       options: type[TransportOptions] = NoOptions) -> None:
    """Make ``MoEDispatcher(..., transport=name)`` build ``factory(setup, options)``.

    ``options``: the transport's options class (``NoOptions`` if it has none); an instance of
    it passed as ``transport=`` picks this transport too. Every rank registers the same.
    """
    if not isinstance(name, str) or not name or name in _TRANSPORTS:
        raise ValueError(f"transport name {name!r} is taken or empty")
    if options is not NoOptions and any(s.options is options for s in _TRANSPORTS.values()):
        raise ValueError(f"options class {options.__name__} belongs to another transport already")
    _TRANSPORTS[name] = TransportSpec(name, factory, options)


def unregister_transport(name: str) -> None:
    """Forget the transport registered as ``name`` (dispatchers built with it keep it)."""
    if _TRANSPORTS.pop(name, None) is None:
        raise ValueError(f"no transport is registered as {name!r}")


def registered_transports() -> list[str]:
    """The registered transports' names, in the order they were registered."""
    return list(_TRANSPORTS)


def low_latency_transports() -> list[str]:
    """The registered transports that offer the low-latency pair (``Transport.offers_low_latency``
    of a factory that is a ``Transport`` class)."""
    return [n for n, s in _TRANSPORTS.items()
            if isinstance(s.factory, type) and issubclass(s.factory, Transport) and s.factory.offers_low_latency]


def transport_spec(name: str) -> TransportSpec:
    """The transport registered as ``name``; ``InvalidArgumentError`` naming the registered ones."""
    spec = _TRANSPORTS.get(name) if isinstance(name, str) else None
    if spec is None:
        names = [repr(n) for n in _TRANSPORTS]
        listed = " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
        raise InvalidArgumentError("transport", name, f"is not {listed}", "pass 'nccl'")
    return spec


def resolve_transport(transport: str | TransportOptions, args: TransportArguments
                      ) -> tuple[TransportSpec, TransportOptions]:
    """The registered transport and its options for ``MoEDispatcher(..., transport=transport,
    **args)``: a name takes the old keyword arguments (``args``, mapped by its options class);
    an options object picks its transport and takes none of them."""
    if isinstance(transport, TransportOptions):
        spec = next((s for s in _TRANSPORTS.values() if type(transport) is s.options and s.options is not NoOptions),
                    None)
        if spec is None:
            raise InvalidArgumentError("transport", transport, "is options of no registered transport (or of one "
                                       "that has none)", "pass a registered transport's name, e.g. 'nccl'")
        for name, value in args.given():
            raise InvalidArgumentError(name, value, f"is an option of the transport, whose options object "
                                       f"({type(transport).__name__}) was passed", f"set {name} in that object")
        return spec, transport
    spec = transport_spec(transport)
    return spec, spec.options.from_arguments(args)
