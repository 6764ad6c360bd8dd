import sys

from agentrun.entrypoint import main

sys.exit(main())
