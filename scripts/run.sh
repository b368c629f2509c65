#!/usr/bin/env bash
# Set up and run corrald in the foreground on its built-in defaults, serving a tiny demo
# model ("tiny") on http://127.0.0.1:11434 so that a chat works within minutes:
#
#   curl http://127.0.0.1:11434/api/chat -d '{"model":"tiny","messages":[{"role":"user","content":"hi"}]}'
#
# The demo model has random weights: it answers nonsense, quickly. Extra arguments go to
# corrald (for example --config PATH). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-system.sh
llama_bin=$(scripts/setup-llama-server.sh)
cargo build --release --locked --bin corrald
export PATH="$llama_bin:$PATH"
# A scratch configuration directory, so that no /etc/corral file changes the defaults.
export CONFIGURATION_DIRECTORY="${CONFIGURATION_DIRECTORY:-$(mktemp -d)}"
corrald=target/release/corrald

"$corrald" --log-target stderr "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"' INT TERM EXIT
api=http://127.0.0.1:11434
for _ in $(seq 100); do curl -sf "$api/api/version" >/dev/null && break; sleep 0.1; done

# Add the demo model once, through the API, as any client would.
if ! curl -sf "$api/api/show" -d '{"model":"tiny"}' >/dev/null; then
    demo=$(mktemp -d)/tiny.gguf
    "$corrald" --write-demo-model "$demo"
    digest="sha256:$(sha256sum "$demo" | cut -d' ' -f1)"
    curl -sf -X POST "$api/api/blobs/$digest" --data-binary "@$demo" >/dev/null
    curl -sf "$api/api/create" -d "{\"model\":\"tiny\",\"files\":{\"tiny.gguf\":\"$digest\"},\"stream\":false}" >/dev/null
fi
echo "corrald serves $api with the demo model \"tiny\"; try:" >&2
echo "  curl $api/api/chat -d '{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":false}'" >&2
wait "$pid"
