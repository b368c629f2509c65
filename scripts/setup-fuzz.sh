#!/usr/bin/env bash
# Install cargo-fuzz (pinned, cached outside the checkout in
# /var/cache/corral-dev/cargo-fuzz/<version>), for scripts/fuzz.sh.  Prints the directory
# holding the cargo-fuzz binary.
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
CACHE=${CORRAL_DEV_CACHE:-/var/cache/corral-dev}/cargo-fuzz/$CARGO_FUZZ_VERSION

if [[ ! -x $CACHE/bin/cargo-fuzz ]]; then
    echo "setup-fuzz: cargo install cargo-fuzz $CARGO_FUZZ_VERSION into $CACHE" >&2
    mkdir -p "$CACHE"
    cargo install --locked --quiet --version "$CARGO_FUZZ_VERSION" --root "$CACHE" cargo-fuzz >&2
fi
echo "$CACHE/bin"
