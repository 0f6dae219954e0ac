#!/usr/bin/env bash
# The test command: installs what the tests need, then runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --system
exec .venv/bin/python -m pytest "$@"
