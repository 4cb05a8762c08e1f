"""Random bad calls at world 3: each is refused with a typed error before anything is sent, or
runs and gives the float64 reference's result; the group works after every one.

Hypothesis draws batches of calls (verb, algorithm, dtype, and any of a dozen ways to get the
call wrong: a 0-d or non-contiguous or meta tensor, sizes that do not fit, a reduce op, group,
root, split list, ``async_op`` or ``algorithm`` of the wrong type or value, a tensor that requires
grad, dtypes that differ or that the backend cannot move). Every rank builds the same call from
the drawn description, with its own data (small non-zero integers, so that sums and products are
exact in every dtype), and reports one line per call. The oracle never asks the library what
should happen: a refusal must be an ``InvalidArgumentError`` (a ``ValueError``/``TypeError``)
raised before any torch.distributed entry point or trace hook saw the call; an accepted call must
match the reference computed from every rank's regenerated data, with the reduce op, root and
splits read from the drawn values by their documented meaning (a value with no meaning must be
refused). The dtype table is also probed against Gloo itself (``test_gloo_dtype_table``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as C

WORLD = 3
VERBS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
ALGOS = {op: ["auto", *C.algorithms(op, backend="gloo")] for op in VERBS}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16", "uint16",
          "uint32", "bool", "complex64", "float8_e4m3fn")
MUTATIONS = ("zero_dim", "noncontig", "meta", "size", "op", "group", "root", "splits", "async", "algorithm",
             "requires_grad", "dtype_mismatch", "same_tensor", "topology")
# Drawn values of the arguments, with their documented meaning (None: must be refused).
OPS = {"sum": "sum", "max": "max", "MIN": "min", "avg": "avg", "product": "prod", "median": None,
       "R.SUM": "sum", "R.MAX": "max", "R.PRODUCT": "prod", "R.BAND": None, "R(MIN)": "min",
       "int3": None, "True": None, "None": None, "float": None, "list": None}
ROOTS = {"0": 0, "2": 2, "np1": 1, "99": None, "-1": None, "True": None, "list": None, "str": None, "None": None}
GROUPS = ("int", "str", "object", "list")
SPLITS = ("float", "short", "negative", "tensor_float", "np_ints", "bool")
ASYNCS = {"True": True, "False": False, "yes": None, "list": None}
BAD_ALGOS = ("fastest", "int", "None", "list")


@dataclasses.dataclass(frozen=True)
class Case:
    verb: str
    algorithm: str
    dtype: str
    mutations: frozenset[str]
    op: str
    root: str
    group: str
    splits: str
    async_op: str
    bad_algorithm: str
    seed: int


cases = st.builds(
    Case,
    verb=st.sampled_from(VERBS),
    algorithm=st.integers(0, 99),  # an index into the verb's algorithms, taken modulo their number
    dtype=st.sampled_from(DTYPES),
    mutations=st.frozensets(st.sampled_from(MUTATIONS), max_size=3),
    op=st.sampled_from(sorted(OPS)),
    root=st.sampled_from(sorted(ROOTS)),
    group=st.sampled_from(GROUPS),
    splits=st.sampled_from(SPLITS),
    async_op=st.sampled_from(sorted(ASYNCS)),
    bad_algorithm=st.sampled_from(BAD_ALGOS),
    seed=st.integers(0, 10_000),
).map(lambda c: dataclasses.replace(c, algorithm=ALGOS[c.verb][c.algorithm % len(ALGOS[c.verb])]))


def _op_value(name: str) -> object:
    R = dist.ReduceOp
    table = {"R.SUM": R.SUM, "R.MAX": R.MAX, "R.PRODUCT": R.PRODUCT, "R.BAND": R.BAND, "R(MIN)": R(R.MIN),
             "int3": 3, "True": True, "None": None, "float": 1.5, "list": [1]}
    return table.get(name, name)


def _root_value(name: str) -> object:
    return {"0": 0, "2": 2, "np1": np.int64(1), "99": 99, "-1": -1, "True": True, "list": [0], "str": "0",
            "None": None}[name]


def _data(rank: int, seed: int, numel: int, signed: bool = True) -> torch.Tensor:
    """Rank ``rank``'s values for case ``seed``, float64: non-zero integers in [-3, 3] ([1, 3]
    unless ``signed``: an unsigned dtype would wrap a negative one)."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    v = torch.randint(1, 4, (numel,), generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    return v * sign if signed else v


def _signed(dtype_name: str) -> bool:
    return not (dtype_name.startswith("uint") or dtype_name == "bool")


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    out = values[0].clone()
    for v in values[1:]:
        out = {"sum": out + v, "avg": out + v, "prod": out * v, "max": torch.maximum(out, v),
               "min": torch.minimum(out, v)}[op]
    return out / len(values) if op == "avg" else out


def _splits_matrix(seed: int) -> list[list[int]]:
    """S[src][dst]: rows rank src sends rank dst (uneven, zeros included), the same on every rank."""
    return [[(seed + 3 * s + d) % 3 for d in range(WORLD)] for s in range(WORLD)]


def _pair_mutations(m: frozenset[str], dtype: torch.dtype, out: torch.Tensor, inp: torch.Tensor,
                    mismatch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-tensor mutations: the ``mismatch`` one of another dtype; one tensor for both."""
    other = (lambda t: t.double() if dtype != torch.float64 else t.float())  # noqa: E731
    if "dtype_mismatch" in m:
        out, inp = (other(out), inp) if mismatch == "output" else (out, other(inp))
    if "same_tensor" in m:
        out, inp = (inp, inp) if mismatch == "input" else (out, out)
    return out, inp


def _build(case: Case, rank: int) -> tuple[dict, object]:
    """The call's arguments on ``rank`` and what checking an accepted call needs."""
    m = case.mutations
    dtype = getattr(torch, case.dtype)
    n = 2 + case.seed % 4
    w = WORLD

    def tensor(numel: int, data: torch.Tensor | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        base = torch.zeros(numel, dtype=torch.float64) if data is None else data
        t = base.to(dtype)
        if shape is not None:
            t = t.reshape(shape)
        if "noncontig" in m and t.numel() > 1:
            t = torch.stack([t, t], dim=-1)[..., 0]  # strided
        if "meta" in m:
            t = t.to("meta")
        if "requires_grad" in m and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    sg = _signed(case.dtype)
    mine = _data(rank, case.seed, w * n, sg)
    verb = case.verb
    kwargs: dict = {}
    if verb in ("all_reduce", "broadcast", "reduce"):
        zero = "zero_dim" in m
        t = tensor(1 if zero else n, mine[:1] if zero else mine[:n], () if zero else None)
        args = [t]
        check = ("inplace", t)
    elif verb == "reduce_scatter":
        inp_n = w * n + (1 if "size" in m else 0)
        out, inp = tensor(n), tensor(inp_n, _data(rank, case.seed, inp_n, sg))
        if "zero_dim" in m:
            out, inp = tensor(1, None, ()), tensor(1, mine[:1], ())
        out, inp = _pair_mutations(m, dtype, out, inp, mismatch="input")
        args = [out, inp]
        check = ("reduce_scatter", out)
    elif verb == "all_gather":
        out_n = w * n + (1 if "size" in m else 0)
        inp = tensor(1, mine[:1], ()) if "zero_dim" in m else tensor(n, mine[:n])
        out = tensor(out_n)
        out, inp = _pair_mutations(m, dtype, out, inp, mismatch="output")
        args = [out, inp]
        check = ("all_gather", out)
    else:  # all_to_all
        S = _splits_matrix(case.seed)
        ins, outs = list(S[rank]), [S[s][rank] for s in range(w)]
        rows_in, rows_out = sum(ins), sum(outs)
        inp = tensor(rows_in * 2, _data(rank, case.seed, rows_in * 2, sg), (rows_in, 2))
        out = tensor(rows_out * 2 + (2 if "size" in m else 0), None, (rows_out + (1 if "size" in m else 0), 2))
        if "zero_dim" in m:
            inp = tensor(1, mine[:1], ())
        if "dtype_mismatch" in m:
            out = out.double() if dtype != torch.float64 else out.float()
        if "same_tensor" in m:
            out = inp
        in_s: object = ins
        if "splits" in m:
            in_s = {"float": [float(s) for s in ins], "short": ins[:-1], "negative": [ins[0] + 1, -1] + ins[2:],
                    "tensor_float": torch.tensor(ins, dtype=torch.float32), "np_ints": [np.int64(s) for s in ins],
                    "bool": [bool(s) for s in ins]}[case.splits]
        args = [out, inp, outs, in_s]
        check = ("all_to_all", out, ins, outs)
    if verb in ("all_reduce", "reduce_scatter", "reduce"):
        if "op" in m:
            kwargs["op"] = _op_value(case.op)
    if verb in ("broadcast", "reduce"):
        key = "src" if verb == "broadcast" else "dst"
        kwargs[key] = _root_value(case.root) if "root" in m else 0
    if "group" in m:
        kwargs["group"] = {"int": 3, "str": "world", "object": object(), "list": [0, 1, 2]}[case.group]
    if "async" in m:
        kwargs["async_op"] = {"True": True, "False": False, "yes": "yes", "list": [True]}[case.async_op]
    kwargs["algorithm"] = case.algorithm
    if "algorithm" in m:
        kwargs["algorithm"] = {"fastest": "fastest", "int": 3, "None": None, "list": ["ring"]}[case.bad_algorithm]
    return {"args": args, "kwargs": kwargs}, check


def _meaning(case: Case) -> dict | None:
    """What an accepted call means, read from the drawn values alone; None if it has none."""
    m = case.mutations
    # only the verbs that take an op or a root are given the drawn one (_build)
    op = OPS[case.op] if "op" in m and case.verb in ("all_reduce", "reduce_scatter", "reduce") else "sum"
    root = ROOTS[case.root] if "root" in m and case.verb in ("broadcast", "reduce") else 0
    if op is None or root is None:
        return None
    if "async" in m and ASYNCS[case.async_op] is None:
        return None
    return {"op": op, "root": root}


def _expected(case: Case, check: tuple, rank: int, meaning: dict) -> torch.Tensor | None:
    """The float64 reference of an accepted call's result on ``rank`` (None: nothing to check)."""
    w, n, seed = WORLD, 2 + case.seed % 4, case.seed
    m = case.mutations
    sg = _signed(case.dtype)
    every = [_data(r, seed, w * n, sg) for r in range(w)]
    kind = check[0]
    if kind == "inplace":
        k = 1 if "zero_dim" in m else n
        vals = [e[:k] for e in every]
        if case.verb == "all_reduce":
            return _reduce(vals, meaning["op"])
        if case.verb == "broadcast":
            return vals[meaning["root"]]
        return _reduce(vals, meaning["op"]) if rank == meaning["root"] else None
    if kind == "reduce_scatter":
        full = _reduce([_data(r, seed, w * n, sg) for r in range(w)], meaning["op"])
        return full[rank * n:(rank + 1) * n]
    if kind == "all_gather":
        return torch.cat([e[:n] for e in every])
    S = _splits_matrix(seed)
    pieces = []
    for s in range(w):
        rows_s = sum(S[s])
        src = _data(s, seed, rows_s * 2, sg).view(rows_s, 2)
        start = sum(S[s][:rank])
        pieces.append(src[start:start + S[s][rank]])
    return torch.cat(pieces)


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.complex64: 1e-6}.get(dtype, 1e-12)


# Entry points whose first call would mean something was sent. isend/irecv themselves are left
# alone: P2POp checks its op is torch's own function, and every point-to-point step of ours goes
# through batch_isend_irecv.
_COUNTED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast",
            "reduce", "batch_isend_irecv", "send", "recv", "barrier", "new_group")


def body_fuzz(rank: int, size: int, batch: list[Case]) -> list[str]:
    """One line per case: 'refused <type>', 'ran', or what went wrong."""
    from topology import Topology

    import collectives.algos.native as native

    started: list[str] = []
    hook = lambda event, call, detail: started.append(event)  # noqa: E731
    entered: list[str] = []
    saved = {n: getattr(dist, n) for n in _COUNTED if hasattr(dist, n)}

    def counting(name, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            entered.append(name)
            return fn(*a, **k)
        return wrapper

    saved_native = (native._reduce_scatter, native._all_gather)
    comm = C.get_communicator()
    out = []
    C.add_trace_hook(hook)
    try:
        for case in batch:
            if "topology" in case.mutations:
                comm.set_topology(Topology.from_nodes([[0, 1], [2]]))
            call, check = _build(case, rank)
            fn = getattr(C, {"reduce_scatter": "reduce_scatter_single", "all_gather": "all_gather_single",
                             "all_to_all": "all_to_all_single"}.get(case.verb, case.verb))
            started.clear()
            entered.clear()
            for n, f in saved.items():
                setattr(dist, n, counting(n, f))
            native._reduce_scatter = counting("rs", saved_native[0])
            native._all_gather = counting("ag", saved_native[1])
            try:
                with C.call_timeout(30):
                    result = fn(*call["args"], **call["kwargs"])
                    if result is not None:
                        result.wait()
            except C.InvalidArgumentError as exc:
                if started or entered:
                    out.append(f"refused after sending ({type(exc).__name__}: {exc}; hooks={started} torch={entered})")
                elif not isinstance(exc, (ValueError, TypeError)):
                    out.append(f"refused as {type(exc).__mro__}, not a ValueError/TypeError")
                else:
                    out.append(f"refused {type(exc).__name__}")
                continue
            except Exception as exc:  # noqa: BLE001 - the finding
                out.append(f"untyped {type(exc).__module__}.{type(exc).__name__}: {str(exc)[:300]}")
                continue
            finally:
                for n, f in saved.items():
                    setattr(dist, n, f)
                native._reduce_scatter, native._all_gather = saved_native
                if "topology" in case.mutations:
                    comm.set_topology(None)
            meaning = _meaning(case)
            if meaning is None:
                out.append(f"accepted a call with no meaning: {call['kwargs']}")
                continue
            want = _expected(case, check, rank, meaning)
            got = check[1]
            if want is not None:
                got64 = got.detach().to(torch.complex128 if got.is_complex() else torch.float64).reshape(-1)
                want = want.reshape(-1).to(got64.dtype)
                if got.dtype == torch.bool:
                    want = (want != 0).to(got64.dtype)
                tol = _tolerance(got.dtype)
                if got64.shape != want.shape or not torch.allclose(got64, want, rtol=tol, atol=tol):
                    out.append(f"wrong result: {got64.tolist()} want {want.tolist()}")
                    continue
            out.append("ran")
    finally:
        C.remove_trace_hook(hook)
    usable = body_usable(rank, size, batch[-1].seed)
    return out + ([f"group unusable after it: {usable}"] if usable else [])


# dtypes every backend's collectives and every algorithm here move and reduce (torch.distributed
# takes them on Gloo): a call that gets nothing wrong in them must run
PLAIN_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")


def _must_run(case: Case) -> bool:
    """A call with nothing wrong: plain dtype, no mutation, and not bruck's uneven all-to-all
    (bruck takes equal splits only, and the drawn splits are uneven)."""
    return not case.mutations and case.dtype in PLAIN_DTYPES and case.algorithm != "bruck"


def body_usable(rank: int, size: int, seed: int) -> str:
    x = _data(rank, seed, 7)
    C.all_reduce(x)
    want = sum(_data(r, seed, 7) for r in range(size))
    return "" if torch.equal(x, want) else f"all_reduce gave {x.tolist()}, want {want.tolist()}"


@settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(cases, min_size=60, max_size=60))
def test_random_bad_calls(worlds, batch: list[Case]) -> None:  # noqa: ANN001
    world = worlds(WORLD)
    problems = []
    for i, case in enumerate(batch):
        got = world.run(body_fuzz, [case], timeout=120)
        problems += [f"case {i} {case} rank {r}: {g[1]}" for r, g in enumerate(got) if len(g) > 1]
        lines = [g[0] for g in got]
        kinds = {line.split(" ")[0] for line in lines}
        for r, line in enumerate(lines):
            if not (line == "ran" or line.startswith("refused Invalid") or line.startswith("refused Unsupported")):
                problems.append(f"case {i} {case} rank {r}: {line}")
        if _must_run(case) and lines[0] != "ran":
            problems.append(f"case {i} {case}: a valid call was refused: {lines[0]}")
        if len(kinds) > 1:
            problems.append(f"case {i} {case}: the ranks disagree: {lines}")
    assert not problems, "\n".join(problems[:10])


def body_probe_gloo(rank: int, size: int) -> dict[str, list[str]]:
    """For every dtype, which of Gloo's collectives take it (run them, over the real backend)."""
    from collectives._types import BACKEND_DTYPES

    out = {"table_says_moves_but_gloo_fails": [], "table_refuses_but_gloo_moves": []}
    for name in DTYPES + ("uint64", "complex128", "float8_e5m2"):
        dtype = getattr(torch, name)
        works = True
        for f in (lambda: dist.all_gather_into_tensor(torch.ones(2 * size).to(dtype), torch.ones(2).to(dtype)),
                  lambda: dist.broadcast(torch.ones(2).to(dtype), 0)):
            try:
                f()
            except Exception:  # noqa: BLE001 - Gloo refused the dtype
                works = False
        says = dtype in BACKEND_DTYPES["gloo"]
        if says and not works:
            out["table_says_moves_but_gloo_fails"].append(name)
        if works and not says:
            out["table_refuses_but_gloo_moves"].append(name)
    return out


def test_gloo_dtype_table(worlds) -> None:  # noqa: ANN001
    got = worlds(2).run(body_probe_gloo)[0]
    assert got == {"table_says_moves_but_gloo_fails": [], "table_refuses_but_gloo_moves": []}


def body_dtypes_gloo_lacks(rank: int, size: int) -> dict[str, str]:
    """int16 and uint16: moved by our point-to-point algorithms (auto routes to them), refused by
    name for native; float8: moved point to point, never reduced."""
    out = {}
    x = torch.full((400_000,), rank + 1, dtype=torch.int16)  # 800 KB: past the small-message rule, so native first
    C.all_reduce(x)
    choice = C.last_choice()
    out["auto int16 all_reduce"] = "" if x.eq(size * (size + 1) // 2).all() and choice.rule == "dtype" \
        else f"{x.tolist()} by {choice}"
    y = torch.full((3,), 7 if rank == 0 else 0, dtype=torch.uint16)
    C.broadcast(y, 0)
    out["auto uint16 broadcast"] = "" if y.eq(7).all() else str(y.tolist())
    for name, call in (("native int16", lambda: C.all_reduce(torch.ones(3, dtype=torch.int16), algorithm="native")),
                       ("float8 sum", lambda: C.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)))):
        try:
            call()
            out[name] = "accepted"
        except C.InvalidArgumentError as exc:
            out[name] = "" if ("int16" in str(exc) or "float8" in str(exc)) else str(exc)
    g = torch.empty(2 * size).to(torch.float8_e4m3fn)
    C.all_gather_single(g, torch.full((2,), float(rank + 1)).to(torch.float8_e4m3fn))
    want = torch.tensor([float(r + 1) for r in range(size) for _ in range(2)])
    out["float8 all_gather"] = "" if torch.equal(g.float(), want) else str(g.float().tolist())
    return out


def test_dtypes_gloo_collectives_lack(worlds) -> None:  # noqa: ANN001
    from collectives._types import backend_moves

    assert not backend_moves("gloo", torch.int16) and backend_moves("gloo", torch.int16, p2p=True)
    for r, got in enumerate(worlds(2).run(body_dtypes_gloo_lacks)):
        assert not any(got.values()), (r, got)
