#!/usr/bin/env bash
# The test command: installs what the tests need, lints, then runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --system
# The linter first: a seconds-long check that fails before the half-hour suite does (rules in pyproject.toml).
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest "$@"
