"""`python -m toolkit.train SCRIPT [ARGS...]`: run an unmodified torchrun-style script as a toolkit worker."""

from toolkit.train.runtime import main

raise SystemExit(main())
