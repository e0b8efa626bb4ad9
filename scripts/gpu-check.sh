#!/usr/bin/env bash
# gpunode on a machine with a real NVIDIA GPU: the checks that cannot run anywhere else.
#
#   bash scripts/gpu-check.sh            # builds the release binary if missing
#   GPUNODE_BIN=/path/to/gpunode bash scripts/gpu-check.sh
#   GPU_CHECK_KEEP=/some/dir bash scripts/gpu-check.sh   # keeps the nodes' and tasks' logs there
#
# Steps (each prints PASS or FAIL; the script exits 1 if any failed):
#   1. the release binary and bubblewrap are there
#   2. NVML sees the real GPUs (`gpunode status --json` of a provider, source nvml)
#   3. a CUDA task runs through two local nodes under --host-env, with only the leased
#      GPU visible inside (a PyTorch matrix product when torch is installed, otherwise a
#      CUDA driver-API program through python3 ctypes)
#   4. the settled receipt's GPU-seconds are non-zero (measured from NVML)
#   5. an owner process on the GPU preempts a running job (owner_policy = yield)
#   6. on a card in MIG mode: while one peer holds a slice of a card, another peer's
#      slice request on it is refused (slice jobs still see the card's parent device and
#      capability files, so a card has one tenant at a time); prints how many MIG
#      devices the slice job saw (SKIP when no GPU is in MIG mode)
# Everything listens on 127.0.0.1 and is stopped at the end. Takes about two minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${GPUNODE_BIN:-target/release/gpunode}
WORK=$(mktemp -d /tmp/gpunode-gpu-check.XXXXXX)
PIDS=()
FAILED=0
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  if [ -n "${GPU_CHECK_KEEP:-}" ]; then
    mkdir -p "$GPU_CHECK_KEEP" && cp "$WORK"/*.log "$GPU_CHECK_KEEP"/ 2>/dev/null
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

pass() { echo "PASS  $1"; }
fail() { echo "FAIL  $1${2:+: $2}"; FAILED=1; }

# --- 1. binary and sandbox ----------------------------------------------------------
if [ ! -x "$BIN" ]; then
  cargo build --release -p gpunode >"$WORK/build.log" 2>&1 || { fail "build" "see $WORK/build.log"; exit 1; }
fi
command -v bwrap >/dev/null 2>&1 || apt-get install -y -qq bubblewrap >/dev/null 2>&1
BIN=$(realpath "$BIN")
if [ -x "$BIN" ] && command -v bwrap >/dev/null 2>&1; then
  pass "release binary $BIN and bubblewrap $(bwrap --version | cut -d' ' -f2)"
else
  fail "release binary and bubblewrap"; exit 1
fi
PY=$(command -v python3 || true)

PORT=$((41000 + RANDOM % 2000))
cat >"$WORK/provider.toml" <<EOF
listen = ["/ip4/127.0.0.1/udp/$PORT/quic-v1"]
mdns = false
backends = ["wasm", "container"]
allow_host_env = true
inventory_poll = "1s"
owner_policy = "yield"
owner_grace = "3s"
price_per_gpu_hour = 1.0
EOF
"$BIN" --data-dir "$WORK/p" --config "$WORK/provider.toml" serve >"$WORK/provider.log" 2>&1 &
PIDS+=($!)
PROVIDER_ID=""
for _ in $(seq 1 100); do
  PROVIDER_ID=$("$BIN" --data-dir "$WORK/p" id 2>/dev/null) && grep -q "quic-v1" "$WORK/provider.log" && break
  sleep 0.2
done
ADDR="/ip4/127.0.0.1/udp/$PORT/quic-v1/p2p/$PROVIDER_ID"

# --- 2. NVML ------------------------------------------------------------------------
STATUS=$("$BIN" --data-dir "$WORK/p" status --json 2>&1)
NGPUS=$(echo "$STATUS" | "$PY" -c 'import json,sys; s=json.load(sys.stdin)["inventory"]; print(len(s["gpus"]) if s["source"]=="nvml" else 0)' 2>/dev/null || echo 0)
if [ "${NGPUS:-0}" -gt 0 ]; then
  pass "NVML sees $NGPUS GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
else
  fail "NVML inventory" "$(echo "$STATUS" | head -5)"
fi

# A CUDA program that holds its GPU for $1 seconds and prints how many GPUs it sees.
cat >"$WORK/cuda_task.py" <<'EOF'
import ctypes, sys, time
hold = float(sys.argv[1]) if len(sys.argv) > 1 else 5
try:
    import torch
    n = torch.cuda.device_count()
    a = torch.randn(8192, 8192, device="cuda")
    end = time.time() + hold
    while time.time() < end:
        (a @ a).sum().item()
    print(f"cuda ok: torch sees {n} GPU(s)", flush=True)
except ImportError:
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0, "cuInit failed"
    n = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(n))
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0, "no CUDA context"
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 30) == 0, "no GPU memory"
    print(f"cuda ok: the driver API sees {n.value} GPU(s)", flush=True)
    time.sleep(hold)
EOF

# --- 3. a CUDA task through two nodes ------------------------------------------------
RUN_OUT=$(cd "$WORK" && timeout 120 "$BIN" --data-dir "$WORK/r" run --bootstrap "$ADDR" --no-mdns \
  --peer "$PROVIDER_ID" --host-env --gpus 1 --mem 8G --timeout 2m --input "$WORK/cuda_task.py" \
  -- python3 /input/cuda_task.py 6 2>&1)
if echo "$RUN_OUT" | grep -q "cuda ok: .* sees 1 GPU(s)"; then
  pass "CUDA task under --host-env sees exactly the leased GPU ($(echo "$RUN_OUT" | grep 'cuda ok' | head -1))"
else
  fail "CUDA task under --host-env" "$(echo "$RUN_OUT" | tail -5)"
fi

# --- 4. the receipt's GPU-seconds ----------------------------------------------------
GPU_S=0
for _ in $(seq 1 60); do
  GPU_S=$("$BIN" --data-dir "$WORK/p" ledger --json 2>/dev/null | "$PY" -c 'import json,sys; print(max([e["gpu_seconds"] for e in json.load(sys.stdin)["recent"]] or [0]))' 2>/dev/null || echo 0)
  [ "$("$PY" -c "print(1 if $GPU_S > 0 else 0)")" = 1 ] && break
  sleep 1
done
if [ "$("$PY" -c "print(1 if ${GPU_S:-0} > 0 else 0)")" = 1 ]; then
  pass "settled receipt carries measured GPU-seconds: $GPU_S"
else
  fail "receipt GPU-seconds" "ledger: $("$BIN" --data-dir "$WORK/p" ledger 2>&1 | tail -5)"
fi

# --- 5. the owner comes first --------------------------------------------------------
(cd "$WORK" && timeout 150 "$BIN" --data-dir "$WORK/r2" run --bootstrap "$ADDR" --no-mdns \
  --peer "$PROVIDER_ID" --host-env --gpus 1 --mem 8G --timeout 2m --retries 0 --input "$WORK/cuda_task.py" \
  -- python3 /input/cuda_task.py 90 >"$WORK/long.log" 2>&1) &
LONG=$!
PIDS+=($LONG)
for _ in $(seq 1 60); do
  grep -q "cuda ok" "$WORK/long.log" && break
  sleep 1
done
"$PY" "$WORK/cuda_task.py" 30 >"$WORK/owner.log" 2>&1 &
PIDS+=($!)
wait "$LONG" 2>/dev/null
if grep -q "owner took the GPU back\|preempted" "$WORK/long.log"; then
  pass "an owner process on the GPU preempted the running job"
else
  fail "owner preemption" "$(tail -5 "$WORK/long.log")"
fi

# --- 6. MIG slices stay with one tenant ---------------------------------------------
SLICE=$(nvidia-smi -L 2>/dev/null | sed -n 's/.*MIG \([0-9]*g\.[0-9]*gb\).*/\1/p' | head -1)
if [ -z "$SLICE" ]; then
  echo "SKIP  MIG isolation (no GPU in MIG mode)"
else
  (cd "$WORK" && timeout 150 "$BIN" --data-dir "$WORK/m1" run --bootstrap "$ADDR" --no-mdns \
    --peer "$PROVIDER_ID" --host-env --gpus 1 --gpu-slice "$SLICE" --mem 4G --timeout 2m \
    -- sh -c 'nvidia-smi -L | grep -c "MIG "; sleep 20' >"$WORK/mig1.log" 2>&1) &
  MIG1=$!
  PIDS+=($MIG1)
  sleep 8
  MIG2=$(cd "$WORK" && timeout 60 "$BIN" --data-dir "$WORK/m2" run --bootstrap "$ADDR" --no-mdns \
    --peer "$PROVIDER_ID" --host-env --gpus 1 --gpu-slice "$SLICE" --mem 4G --timeout 1m \
    --no-wait --retries 0 -- true 2>&1)
  wait "$MIG1" 2>/dev/null
  if grep -q "^[0-9]" "$WORK/mig1.log" && ! echo "$MIG2" | grep -q "exited 0"; then
    pass "while a peer holds a $SLICE slice, another peer gets no slice of the same card (the slice job saw $(head -1 "$WORK/mig1.log") MIG device(s))"
  else
    fail "MIG isolation" "first: $(head -3 "$WORK/mig1.log"); second: $(echo "$MIG2" | tail -2)"
  fi
fi

[ "$FAILED" = 0 ] && echo "gpu-check: all steps passed" || echo "gpu-check: some steps FAILED"
exit "$FAILED"
