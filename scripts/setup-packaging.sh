#!/usr/bin/env bash
# Install the tools that build corral's packages: cargo-deb (pinned, cached outside the
# checkout in /var/cache/corral-dev/cargo-deb) and, through setup-system.sh, lintian and
# rpm.  Prints the directory holding the cargo-deb binary.
set -euo pipefail

CARGO_DEB_VERSION=3.8.0
CACHE=${CORRAL_DEV_CACHE:-/var/cache/corral-dev}/cargo-deb/$CARGO_DEB_VERSION

if [[ ! -x $CACHE/bin/cargo-deb ]]; then
    echo "setup-packaging: cargo install cargo-deb $CARGO_DEB_VERSION into $CACHE" >&2
    mkdir -p "$CACHE"
    cargo install --locked --quiet --version "$CARGO_DEB_VERSION" --root "$CACHE" cargo-deb >&2
fi
echo "$CACHE/bin"
