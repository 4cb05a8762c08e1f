"""Peer memory is sized from the agreed ``COMMOPS_PEER_BYTES``: ``torchrun --nproc-per-node N
tests/gpu_settings_check.py`` (run by ``tests/test_collectives_settings.py``).

Ranks may share GPUs (``local_rank % device_count``): the peer buffers of one GPU are mapped from
another process as a peer's are, and nothing here sends through NCCL. First the last rank is
given a larger value: building ``PeerMemory`` (before any collective, as the overlap operators
do) must raise ``SettingsMismatch`` on every rank naming the setting and both values, before any
buffer is allocated or mapped. Then every rank is given the same value, which the buffers get.
Prints one line per failure and a summary; exits non-zero on any. ``--json`` writes the results
by family (``families()``; ``tests/_checks.py``), one pytest case each.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from collectives import _env  # noqa: E402
from collectives.peer import PeerMemory  # noqa: E402
from tests._checks import Checks, write_results  # noqa: E402


def families() -> tuple[str, ...]:
    """The families a run records checks into: the values disagree, then agree."""
    return ("peer_bytes/mismatch", "peer_bytes/agreed")


def _with_peer_bytes(value: int) -> None:
    os.environ["COMMOPS_PEER_BYTES"] = str(value)
    _env._read.cache_clear()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ck = Checks(families(), rank)
    ranks = list(range(world))

    ck.begin("peer_bytes/mismatch")
    ck.count()
    _with_peer_bytes((128 if rank == world - 1 else 64) << 20)
    g = dist.new_group(ranks, backend="cpu:gloo,cuda:nccl")
    before = torch.cuda.memory_allocated()
    try:
        PeerMemory(C.get_communicator(g)).close()
        ck.fail("different COMMOPS_PEER_BYTES: PeerMemory was built")
    except C.SettingsMismatch as exc:
        text = str(exc)
        for words in ("COMMOPS_PEER_BYTES", f"rank(s) {ranks[:-1]} have {64 << 20}", f"rank(s) [{world - 1}] have {128 << 20}"):
            if words not in text:
                ck.fail(f"different COMMOPS_PEER_BYTES: the error lacks {words!r}: {text}")
    if torch.cuda.memory_allocated() != before:
        ck.fail("different COMMOPS_PEER_BYTES: memory was allocated before the error")
    C.destroy(g)

    ck.begin("peer_bytes/agreed")
    ck.count()
    _with_peer_bytes(32 << 20)
    g = dist.new_group(ranks, backend="cpu:gloo,cuda:nccl")
    comm = C.get_communicator(g)
    pm = PeerMemory(comm)
    if pm.slot_bytes != 32 << 20 or comm._settings is None or comm._settings.peer_bytes != 32 << 20:
        ck.fail(f"equal COMMOPS_PEER_BYTES: slots of {pm.slot_bytes} B, agreed {comm._settings}")
    pm.close()
    C.destroy(g)

    for f in ck.failures:
        print(f"rank {rank}: FAILED {f}", flush=True)
    print(f"rank {rank}: {ck.checks} checks, {len(ck.failures)} failed", flush=True)
    if args.json:
        merged = ck.gather()  # object collectives: over Gloo, no NCCL communicator is made
        if rank == 0:
            write_results(args.json, merged)
    C.destroy()
    return 1 if ck.failures else 0


if __name__ == "__main__":
    sys.exit(main())
