"""The same benchmark for any collective: ``--op all_reduce|reduce_scatter|all_gather|all_to_all|broadcast|reduce``.

    torchrun --nproc-per-node 4 launch/bench_collectives.py --op all_to_all -b 1K -e 16M
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
