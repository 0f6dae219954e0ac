"""`python -m toolkit.agent` (toolkit/agent/commands.py)."""

import sys

from toolkit.agent.commands import main

sys.exit(main())
