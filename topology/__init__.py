"""commops topology: who sits on which node, how they are linked, and what that costs.

``discover(group)`` builds a :class:`Topology` from facts the ranks exchange (or loads one from
JSON); ``python -m topology`` prints it under torchrun. The cost model and hierarchical
algorithms build on it.
"""

from .discover import discover
from .model import RankPlace, Tier, Topology

__all__ = ["discover", "Topology", "Tier", "RankPlace"]
