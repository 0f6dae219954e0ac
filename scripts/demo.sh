#!/usr/bin/env bash
# The main job: install, then show the launch plan of a 2-host sample job (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/fleet plan --project examples --script train.py --hosts=node1:2,node2:2
