#!/usr/bin/env bash
# Check that corral builds with the rust-version Cargo.toml declares, with Debian's own
# rustc of that version (rustc-web, from the Debian archive: no rustup download), in a
# target directory cached outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

MSRV=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
# The Debian build of that release (bookworm main).
DEBIAN_VERSION=1.85.0+dfsg3-1~deb12u3
[[ $DEBIAN_VERSION == "$MSRV".* ]] || { echo "check-msrv: no Debian rustc pinned for $MSRV" >&2; exit 1; }
CACHE=${CORRAL_DEV_CACHE:-/var/cache/corral-dev}/msrv-target

if ! /usr/bin/rustc --version 2>/dev/null | grep -q "^rustc $MSRV"; then
    [[ $(id -u) == 0 ]] || { echo "check-msrv: Debian's rustc $MSRV is missing; run as root" >&2; exit 1; }
    echo "check-msrv: apt-get install rustc-web cargo-web $DEBIAN_VERSION" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends --allow-downgrades \
        "rustc-web=$DEBIAN_VERSION" "cargo-web=$DEBIAN_VERSION" \
        "libstd-rust-web-dev=$DEBIAN_VERSION" "libstd-rust-web-$MSRV=$DEBIAN_VERSION" >&2
fi
# Only Debian's toolchain on PATH: rustup's proxies would pick another.
env PATH=/usr/bin:/bin RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc CARGO_TARGET_DIR="$CACHE" \
    /usr/bin/cargo check --all-targets --locked --quiet
echo "check-msrv: builds with rustc $MSRV" >&2
