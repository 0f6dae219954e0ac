"""`python -m toolkit.scheduler` (see toolkit/scheduler/__init__.py)."""

import sys

from toolkit.scheduler import main

sys.exit(main())
