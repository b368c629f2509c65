#!/usr/bin/env bash
# Set up and run corrald in the foreground on its built-in defaults (no configuration
# file): it serves http://127.0.0.1:11434.  Extra arguments go to corrald
# (for example --config PATH).  Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-system.sh
llama_bin=$(scripts/setup-llama-server.sh)
cargo build --release --locked --bin corrald
export PATH="$llama_bin:$PATH"
# A scratch configuration directory, so that no /etc/corral file changes the defaults.
export CONFIGURATION_DIRECTORY="${CONFIGURATION_DIRECTORY:-$(mktemp -d)}"
exec target/release/corrald --log-target stderr "$@"
