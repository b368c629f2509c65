#!/usr/bin/env bash
# Install cargo-deny (pinned, cached outside the checkout in
# /var/cache/corral-dev/cargo-deny) for the dependency checks of scripts/test.sh.
# Prints the directory holding the binary.
set -euo pipefail

CARGO_DENY_VERSION=0.20.2
CACHE=${CORRAL_DEV_CACHE:-/var/cache/corral-dev}/cargo-deny/$CARGO_DENY_VERSION

if [[ ! -x $CACHE/bin/cargo-deny ]]; then
    echo "setup-deny: cargo install cargo-deny $CARGO_DENY_VERSION into $CACHE" >&2
    mkdir -p "$CACHE"
    # No default features: the checks CI runs need no network (no advisory fetching).
    cargo install --locked --quiet --no-default-features --version "$CARGO_DENY_VERSION" \
        --root "$CACHE" cargo-deny >&2
fi
echo "$CACHE/bin"
