"""The inter-node link goes down mid-run (emulated cluster only):

    sudo python launch/emulate_cluster.py --nodes 2 --procs-per-node 2 --inter-node-mbit 400 -- \\
        launch/faults/link_down.py

After the warm-up, the last node's first rank sets its node's link down (``ip link set eth0
down`` in its own network namespace); the ranks of node 0 then time out on the next all-reduce
and name the ranks that did not get there (the far node's progress stops reaching the store).
"""

import os
import subprocess
import sys
import time

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    nodes = comm.topology.nodes()
    far = nodes[-1]
    C.barrier()
    time.sleep(1.0)  # every rank has finished the warm-up's last messages
    if comm.rank == far[0]:
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    time.sleep(1.0)  # the link is down before anyone calls
    C.all_reduce(torch.ones(1 << 16, device=dev))


if __name__ == "__main__":
    if not os.environ.get("GROUP_RANK"):
        sys.exit("link_down.py runs under launch/emulate_cluster.py (it sets a namespace's link down)")
    sys.exit(run("link_down", "the last node's link goes down before an all-reduce",
                 "node 0's ranks raise CollectiveTimeout naming the last node's ranks; nothing hangs", body))
