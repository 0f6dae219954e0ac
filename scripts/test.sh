#!/usr/bin/env bash
# The test command: installs what the tests need, lints, then runs the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --system
# The linter first: a seconds-long check that fails before the quarter-hour suite does (rules in pyproject.toml).
.venv/bin/ruff check --quiet .
# Two processes (pytest-xdist; tests/conftest.py groups the tests): the suite mostly waits on start-ups and
# timeouts, so two nearly halve its time on a two-core machine. TOOLKIT_TEST_WORKERS=0 runs it in one process.
# --no-loadscope-reorder: the files are taken in tests/conftest.py's order, the longest first (xdist's own order,
# by number of tests, took the long files of few tests last and left one process working alone at the end).
# A short temporary root of its own: job directories under it hold Unix sockets, whose paths are limited to 107
# bytes, and pytest's default (/tmp/pytest-of-USER/pytest-N/popen-gwN/) spends a third of that. Kept when a
# test fails (the jobs' logs are evidence), removed when all pass.
tmp=$(mktemp -d /tmp/tk-XXXXXX)
status=0
.venv/bin/python -m pytest -n "${TOOLKIT_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --basetemp "$tmp" "$@" || status=$?
if [ "$status" = 0 ]; then rm -rf "$tmp"; else echo "test.sh: the tests' files are kept in $tmp" >&2; fi
exit "$status"
