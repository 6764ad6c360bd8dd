"""``python -m agentrun.fake_anthropic --scenario FILE [--port P] [--host H]``."""

import sys

from agentrun.fake_anthropic import main

if __name__ == "__main__":
    sys.exit(main())
