"""commops overlap: GEMM + collective operators and the tensor/expert-parallel layers built on them.

Nothing is exported yet; the operators land with the overlap work.
"""

__all__: list[str] = []
