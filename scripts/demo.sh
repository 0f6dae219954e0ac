#!/usr/bin/env bash
# The main job: install, then train the sample on this machine with 2 workers, kill -9 one mid-training, and
# compare the result with an uninterrupted run (scripts/demo.py says how).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python scripts/demo.py
