#!/usr/bin/env bash
# Install the official Python clients (`ollama`, `openai`, `anthropic`) from PyPI, pinned, into a
# virtual environment in a cache outside the checkout, once; later runs only check the
# pins and print the path.
#
# Usage: scripts/setup-python-clients.sh     prints the venv's python on stdout
#
# Environment:
#   CORRAL_DEV_CACHE   cache root (default /var/cache/corral-dev as root,
#                      else ${XDG_CACHE_HOME:-~/.cache}/corral-dev)
set -euo pipefail

PINS=(ollama==0.6.3 openai==3.57.0 anthropic==2.17.0)
if [[ $(id -u) == 0 ]]; then default_cache=/var/cache/corral-dev
else default_cache=${XDG_CACHE_HOME:-$HOME/.cache}/corral-dev; fi
VENV=${CORRAL_DEV_CACHE:-$default_cache}/python-clients
PY=$VENV/bin/python
STAMP=$VENV/.pins

log() { echo "setup-python-clients: $*" >&2; }

if [[ -x $PY && -f $STAMP && $(cat "$STAMP") == "${PINS[*]}" ]]; then
    echo "$PY"
    exit 0
fi

command -v python3 >/dev/null || { log "python3 is missing (run scripts/setup-system.sh)"; exit 1; }
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
# Debian ships venv without ensurepip unless python3-venv is installed: then make the
# venv bare and install into it with the system pip (--python, pip >= 22.3).
if python3 -m venv "$VENV" >/dev/null 2>&1; then
    pip=("$PY" -m pip)
else
    log "python3 -m venv failed; creating it without pip"
    rm -rf "$VENV"
    python3 -m venv --without-pip "$VENV"
    pip=(python3 -m pip --python "$PY")
fi
log "pip install ${PINS[*]}"
"${pip[@]}" install --quiet --disable-pip-version-check "${PINS[@]}" >&2
"$PY" -c 'import ollama, openai, anthropic' >&2
echo "${PINS[*]}" >"$STAMP"
echo "$PY"
