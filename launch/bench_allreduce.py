"""The main job: every all-reduce algorithm against the backend's own, at every size.

    torchrun --nproc-per-node 4 launch/bench_allreduce.py -b 1K -e 16M
    mpiexec -n 3 python launch/bench_allreduce.py -b 1K -e 1M
    torchrun --nproc-per-node 2 launch/bench_allreduce.py -b 8 -e 1G -d bfloat16 --graph both   # GPUs

Flags follow nccl-tests (-b -e -f -d -n -w -c) plus -a/--algorithms and --json/--csv/--plot;
``--help`` lists them. Every run leaves a record, ``results.json`` and ``plot.png`` in a new
``commops-results/all_reduce-<date>-<time>/`` (``--out DIR`` elsewhere, ``--out none`` for none),
and prints where. Exit code 1 if any value was wrong.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cli import main_all_reduce  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_all_reduce())
