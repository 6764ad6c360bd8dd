"""agentrun's tests, a package so the benchmarks share its harnesses (``tests.kubekit``,
``tests.realkube``, ``tests.helmtools``, ``tests.workerkit``) by import, as the tests import
``benchmarks.x``; pytest puts the repository root on ``sys.path`` (pyproject ``pythonpath``).
"""
