#!/usr/bin/env bash
# Install toolkit and its test tools into ./.venv; with --system also the Debian packages the tests need
# (run as root). Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--system" ]; then
    need=()
    [ -x /usr/sbin/sshd ] || need+=(openssh-server)
    command -v ip >/dev/null || need+=(iproute2)
    command -v ps >/dev/null || need+=(procps)
    if [ ${#need[@]} -gt 0 ]; then
        if [ "$(id -u)" != 0 ]; then
            echo "install.sh: the tests need ${need[*]}; run 'sudo scripts/install.sh --system'" >&2
            exit 1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
    touch "$stamp"
fi
