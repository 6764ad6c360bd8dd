"""agentrun's benchmarks and chaos soak: ``python -m benchmarks.report --preset small``.

A package run from the repository root (``python -m benchmarks.soak``, ``python -m
benchmarks.store_bench``): its modules import each other as ``benchmarks.x``, and the tests import
them the same way (pyproject's pytest ``pythonpath`` puts the root on ``sys.path``).
"""
