"""The real-node tier: ``pytest -m e2e -n 0 tests/e2e`` (docs/e2e.md)."""
