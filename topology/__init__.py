"""commops topology: who sits on which node, how they are linked, and what that costs.

``discover(group)`` builds a :class:`Topology` from facts the ranks exchange (or loads one from
JSON); ``python -m topology`` prints it under torchrun. ``topology.groups`` derives the intra-node
and rail sub-groups, ``topology.cost`` prices the communication plan an algorithm describes
(``CostPlan``) on a topology with a calibrated :class:`~topology.cost.Machine` (fitted by
``topology.calibrate``, files in ``topology/calibrations/``), and ``python -m topology.simulate``
predicts 8 to 4096 GPUs.

This is the bottom layer: it imports nothing of ``collectives``, ``overlap``, ``bench`` or
``launch``. What it needs from above comes in as arguments (the launcher's node and local ranks
for ``discover``, the algorithms for ``topology.simulate.simulate``); the ``__main__`` modules are
programs and may use any layer.
"""

from .discover import discover
from .model import RankPlace, Tier, Topology

__all__ = ["discover", "Topology", "Tier", "RankPlace"]
