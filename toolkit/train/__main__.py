"""`python -m toolkit.train SCRIPT [ARGS...]`: run a training script as a toolkit worker (toolkit.train.wrapper)."""

from toolkit.train.wrapper import main

raise SystemExit(main())
