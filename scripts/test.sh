#!/usr/bin/env bash
# The one step to test gpunode, on a fresh machine or not: installs what the tests need
# and is missing (scripts/install-deps.sh, quick when everything is there), then runs
# every test of the workspace. Extra arguments go to `cargo test` (e.g. a test filter
# after `--`). On a machine that already has the dependencies, `cargo test --workspace`
# alone does the same.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo test --workspace "$@"
