"""A rank with no tokens skips its MoE layer (a data-dependent branch around the layer, a common
expert-parallel bug): the others time out in the dispatch, naming it.
``torchrun --nproc-per-node 3 launch/faults/skipped_moe_layer.py``"""

import sys
import time

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    from overlap.layers import MoELayer

    torch.manual_seed(0)  # the same router and experts on every rank
    layer = MoELayer(16, 24, 2 * comm.size, 2, comm.group, dtype=torch.float32, device=dev)
    tokens = 0 if comm.rank == culprit else 5 + comm.rank
    x = torch.randn(tokens, 16, device=dev)
    with torch.no_grad():
        layer(x)  # a good step: every rank takes part, the culprit with no tokens
        if tokens == 0:
            time.sleep(3600)  # "nothing to compute": skips the layer; the launcher stops it
        layer(x)


if __name__ == "__main__":
    sys.exit(run("skipped_moe_layer", "the last rank, with no tokens, skips its MoE layer in the second step",
                 "the others raise CollectiveTimeout in the dispatch naming it; diagnose: it never entered that "
                 "call", body))
