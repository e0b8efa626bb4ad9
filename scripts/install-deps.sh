#!/usr/bin/env bash
# Installs what building and testing gpunode needs beyond a Rust toolchain:
# - rustfmt and clippy (CI checks),
# - the wasm32-wasip1 target (the example task under examples/checksum),
# - iperf3 (the transfer benchmark compares against it),
# - iptables (the NAT lab of the e2e test that punches holes between members),
# - bubblewrap (the container backend and its tests; prlimit and setpriv come with
#   util-linux),
# - Node.js and the js-libp2p packages of the interop test (tests/interop),
# - chromium and puppeteer-core, for the dashboard's browser test (tests/dashboard).
# Safe to run again; CI runs it before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
  rustup target add wasm32-wasip1 >/dev/null
elif ! rustc --print target-list | grep -qx wasm32-wasip1; then
  echo "the wasm32-wasip1 target is needed for examples/checksum; install it with rustup" >&2
  exit 1
fi

apt_install() {
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "please install: $*" >&2
    return 1
  fi
}
command -v bwrap >/dev/null 2>&1 || apt_install bubblewrap || { echo "bubblewrap is needed for the container backend and its tests" >&2; exit 1; }
command -v iptables >/dev/null 2>&1 || apt_install iptables || { echo "iptables is needed for the NAT lab test (tests/tests/e2e/nat.rs)" >&2; exit 1; }
command -v iperf3 >/dev/null 2>&1 || apt_install iperf3 || echo "iperf3 missing: the transfer benchmark will skip its comparison" >&2

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  apt_install nodejs npm || { echo "node and npm are needed for the interop test; install Node.js 20 or newer" >&2; exit 1; }
fi
if [ ! -d tests/interop/node_modules ] || [ tests/interop/package-lock.json -nt tests/interop/node_modules ]; then
  npm ci --prefix tests/interop --no-audit --no-fund --loglevel=error
fi
command -v chromium >/dev/null 2>&1 || apt_install chromium || { echo "chromium is needed for the dashboard's browser test (tests/tests/e2e/dashboard.rs)" >&2; exit 1; }
if [ ! -d tests/dashboard/node_modules ] || [ tests/dashboard/package-lock.json -nt tests/dashboard/node_modules ]; then
  # The browser is Debian's chromium: puppeteer must not download its own.
  PUPPETEER_SKIP_DOWNLOAD=1 npm ci --prefix tests/dashboard --no-audit --no-fund --loglevel=error
fi
echo "dependencies ready"
