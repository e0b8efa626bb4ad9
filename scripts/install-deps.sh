#!/usr/bin/env bash
# Installs what building and testing gpunode needs beyond a Rust toolchain:
# - rustfmt and clippy (CI checks),
# - Node.js and the js-libp2p packages of the interop test (tests/interop).
# Safe to run again; CI runs it before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
  else
    echo "node and npm are needed for the interop test; install Node.js 20 or newer" >&2
    exit 1
  fi
fi
if [ ! -d tests/interop/node_modules ] || [ tests/interop/package-lock.json -nt tests/interop/node_modules ]; then
  npm ci --prefix tests/interop --no-audit --no-fund --loglevel=error
fi
echo "dependencies ready"
