"""agentrun's benchmarks and chaos soak: ``python -m benchmarks.report --preset small``.

The modules also run as scripts (``python benchmarks/store_bench.py``) and import each other by
their plain names, so this folder is put on ``sys.path`` by whichever of them runs first.
"""

import sys
from pathlib import Path

_here = str(Path(__file__).resolve().parent)
if _here not in sys.path:
    sys.path.insert(0, _here)
