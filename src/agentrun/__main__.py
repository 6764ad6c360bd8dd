import sys

from agentrun.cli import main

sys.exit(main())
