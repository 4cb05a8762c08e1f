"""commops topology: who sits on which node, how they are linked, and what that costs.

Nothing is exported yet; discovery and the cost model land with the topology work.
"""

__all__: list[str] = []
