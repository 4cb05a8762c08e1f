"""commops bench: measuring functions that return records, and their reports.

``bench.harness`` times collectives (nccl-tests' conventions: algbw, busbw, ``#wrong``),
``bench.report`` prints tables and writes JSON, CSV and plots, ``bench.reference`` holds the
float64 references, ``bench.calibrate`` measures the links the cost model is fitted to, and
``bench.cli`` is the thin command line used by ``launch/``.
"""

__all__ = ["harness", "report", "reference", "calibrate", "cli"]
