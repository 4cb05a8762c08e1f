"""commops topology: who sits on which node, how they are linked, and what that costs.

``discover(group)`` builds a :class:`Topology` from facts the ranks exchange (or loads one from
JSON); ``python -m topology`` prints it under torchrun. ``topology.groups`` derives the intra-node
and rail sub-groups, ``topology.cost`` prices every algorithm on a topology with a calibrated
:class:`~topology.cost.Machine` (``topology.calibrate``, files in ``topology/calibrations/``), and
``python -m topology.simulate`` predicts 8 to 4096 GPUs.
"""

from .discover import discover
from .model import RankPlace, Tier, Topology

__all__ = ["discover", "Topology", "Tier", "RankPlace"]
