#!/usr/bin/env bash
# Installs what building and testing gpunode needs beyond a Rust toolchain.
# Safe to run again; CI runs it before the tests.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
echo "dependencies ready"
