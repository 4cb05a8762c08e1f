"""The model zoo's representative families on one GPU: sharded by ``parallelize`` from their plans,
their decode step eager and replayed from a CUDA graph, against the unsharded model (run by
``tests/test_gpu_models_zoo.py``): ``torchrun --nproc-per-node N tests/gpu_models_check.py [--json F]
[--records F]``.

With one rank the group is world 1 over NCCL. With more ranks than GPUs the ranks share the GPU
(``tests._checks.shared_gpu_ranks``): the group's own traffic is Gloo's, and the layers'
exchanges go through peer memory, which a CUDA graph can hold: the GEMM operators with
``strategy="copy_engine"`` and the experts' rows over ``PeerOptions`` (the peer transport).

One family per (model type, layout) of ``tests/test_models_zoo.py``'s ``SUBSET`` that the
installed transformers has a plan for. Each, in float32 on the GPU, the tiny model of
``bench/model_zoo.py`` (the same on every rank):

- the unsharded model prefills a prompt of 2 x 6 tokens into a ``StaticCache``, then decodes one
  token per row at position 6, for 3 fresh random tokens: the references;
- ours does the same eagerly: each decode's logits within 1e-4 of the largest reference logit;
- ours' decode step (the same position, the token written into its input in place) captured in a
  CUDA graph and replayed for each of the 3 tokens: each replay's logits within the same bound;
- the unsharded model's own step captured too: where ``transformers``' model itself cannot be
  captured, ours is not asked to be (the reason is recorded, and ours' eager checks still count).

``--records F``: per family, the largest errors, whether each model was captured, and why not.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOL = 1e-4
PROMPT = (2, 6)
TOKENS = 3


def _cases() -> list[tuple[str, str]]:
    from bench.model_zoo import families as zoo  # deferred: transformers
    from tests.test_models_zoo import SUBSET

    plans = zoo()
    return [(k, lay) for k, (layouts, _) in sorted(SUBSET.items()) for lay in layouts if plans.get(k, {}).get(lay)]


def families() -> tuple[str, ...]:
    """One family per (model type, layout) of the subset with a plan in the installed transformers."""
    return tuple(f"{k}/{lay}" for k, lay in _cases())


class Decode:
    """A model's decode step at a fixed position of a prefilled ``StaticCache``, its token an input
    written in place, its logits a tensor the step overwrites (so a CUDA graph can replay it)."""

    def __init__(self, model: Any, prompt: torch.Tensor) -> None:
        from transformers import StaticCache  # deferred: the models extra

        self.model, n = model, prompt.shape[1]
        self.cache = StaticCache(config=model.config, max_cache_len=n + 1)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True,
                  cache_position=torch.arange(n, device=prompt.device))
        self.n = n
        self.token = prompt[:, -1:].clone()
        self.pos = torch.tensor([n], device=prompt.device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self) -> None:
        from bench.model_step import _rewind

        _rewind(self.cache, self.n)
        with torch.no_grad():
            out = self.model(input_ids=self.token, past_key_values=self.cache, use_cache=True,
                             cache_position=self.pos, position_ids=self.pos.view(1, 1)).logits
        from bench.model_agree import full_tensor

        out = full_tensor(out)
        if self.logits is None:
            self.logits = out.detach().clone()
        else:
            self.logits.copy_(out)

    def capture(self) -> None:
        from bench.harness import _captured

        self.step()
        self.graph = _captured(self.step, 1)  # type: ignore[assignment]

    def run(self, token: torch.Tensor, graph: bool) -> torch.Tensor:
        self.token.copy_(token)
        if graph:
            assert self.graph is not None
            self.graph()  # type: ignore[operator]
        else:
            self.step()
        if self.token.is_cuda:
            torch.cuda.synchronize()
        assert self.logits is not None
        return self.logits.clone()


def _groups(layout: str, world: int) -> tuple[Any, Any]:
    everyone = dist.new_group(list(range(world)))
    if layout == "tp":
        return everyone, None
    return dist.new_subgroups(1)[0], everyone


def _held(ck: Any, what: str, step: Decode, tokens: list[torch.Tensor], want: list[torch.Tensor], graph: bool) -> float:
    """A check per token that ``step``'s logits are within ``TOL`` of the reference's; the largest error."""
    from bench.model_zoo import _rel

    errs = [_rel(step.run(t, graph=graph), w) for t, w in zip(tokens, want)]
    for i, e in enumerate(errs):
        ck.count()
        if not e <= TOL:
            ck.fail(f"rank {dist.get_rank()} {what} {i} differs by {e:.3g} (relative)")
    return max(errs)


def check_family(ck: Any, kind: str, layout: str, dev: torch.device, world: int) -> dict[str, Any]:
    """The checks of one family into ``ck`` (collective); its record."""
    from bench.model_zoo import _rel, tiny_model  # deferred: transformers
    from overlap import parallelize
    from overlap.moe import PeerOptions

    rec: dict[str, Any] = {"family": f"{kind}/{layout}", "world": world}
    gen = torch.Generator().manual_seed(7)
    ref = tiny_model(kind).to(dev)
    vocab = int(ref.config.get_text_config().vocab_size)
    prompt = torch.randint(3, vocab, PROMPT, generator=gen).to(dev)
    tokens = [torch.randint(3, vocab, (PROMPT[0], 1), generator=gen).to(dev) for _ in range(TOKENS)]
    ref_step = Decode(ref, prompt)
    want = [ref_step.run(t, graph=False) for t in tokens]
    rec["reference_captured"] = False
    if dev.type == "cuda":  # elsewhere, the eager checks alone (a CPU run of this script's logic)
        try:
            ref_step.capture()
            rec["reference_captured"] = all(_rel(ref_step.run(t, True), w) <= TOL for t, w in zip(tokens, want))
        except Exception as e:  # noqa: BLE001 - recorded: transformers' own model cannot be captured here
            rec["reference_not_captured"] = f"{type(e).__name__}: {e}"[:300]
    tp_group, ep_group = _groups(layout, world)
    shared = dev.type == "cuda" and world > torch.cuda.device_count()
    kw: dict[str, Any] = {}
    if shared:  # what a CUDA graph can hold with ranks on one GPU: peer memory
        kw["strategy"] = "copy_engine"
        if ep_group is not None:
            kw["moe_transport"] = PeerOptions(max_tokens=PROMPT[0] * PROMPT[1],
                                              top_k=int(getattr(ref.config, "num_experts_per_tok", 2)))
    model = parallelize(copy.deepcopy(ref), tp_group=tp_group, ep_group=ep_group, **kw)
    rec["sharded"] = len(getattr(model, "commops_parallel", {}).get("sharded", {}))
    ours = Decode(model, prompt)
    rec["eager_err"] = _held(ck, f"{kind}/{layout}: eager decode", ours, tokens, want, graph=False)
    if not rec["reference_captured"]:
        return rec
    try:
        ours.capture()
    except Exception as e:  # noqa: BLE001 - a failure of ours, recorded
        ck.count()
        ck.fail(f"rank {dist.get_rank()} {kind}/{layout}: capture raised {type(e).__name__}: {str(e)[:300]}")
        rec["captured"], rec["not_captured"] = False, f"{type(e).__name__}: {e}"[:300]
        return rec
    rec["captured"] = True
    rec["graph_err"] = _held(ck, f"{kind}/{layout}: graph replay", ours, tokens, want, graph=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    from tests._checks import Checks, check_arguments, report, shared_gpu_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--records", help="per family: errors, captured or why not (JSON, rank 0)")
    own, rest = p.parse_known_args(argv)
    args = check_arguments(families(), rest)
    comm, dev = shared_gpu_ranks()
    world, rank = dist.get_world_size(), dist.get_rank()
    ck = Checks(families(), rank)
    records = []
    for kind, layout in _cases():
        name = f"{kind}/{layout}"
        if name not in args.only:
            continue
        with ck.family(name):
            try:
                rec = check_family(ck, kind, layout, dev, world)
            except Exception as e:  # noqa: BLE001 - the family's failure, with where it came from
                ck.count()
                ck.fail(f"rank {rank} {name}: {type(e).__name__}: {str(e)[:300]} "
                        f"({traceback.format_exc().strip().splitlines()[-3][:200]})")
                rec = {"family": name, "world": world, "error": f"{type(e).__name__}: {e}"[:300]}
        records.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
        torch.cuda.synchronize()
        dist.barrier()
    failed = report(ck, args.json, "model zoo on one GPU", world)
    if rank == 0 and own.records:
        Path(own.records).write_text(json.dumps({"world": world, "device": torch.cuda.get_device_name(),
                                                 "records": records}, indent=1) + "\n")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
