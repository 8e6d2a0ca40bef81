#!/bin/bash
# The GPU session's one prepared device check (docs/benchmarks.md, "On an H200"): run it from
# the repository root on the accelerator host, with the peer's JSON made beforehand on a CPU
# machine (the device host reaches no network, so vLLM cannot be installed there):
#
#   /tmp/vllmpeer/bin/python ../shared/peers/vllm_kv_bench.py --configs dsv4 --batches 256 \
#       --repeats 1 --json .devrun/vllm.json && cp ../shared/peers/vllm_kv_bench.py .devrun/
#   bash benchmarks/device_check.sh .devrun        # on the device host; logs in $OUT or /tmp
#
# Stages, most important first, each under its own time cap (about 7 minutes in all on an
# H200, ~3.5 of them compiling): the demo (its parity check is what the GPU broke once), the
# paired vs_vllm run, the synthetic decode step with and without a prefix index, the kernels.
set -u
peer_dir=${1:-.devrun}
out=${OUT:-/tmp/flatkv_device_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
t0=$(date +%s)
stage() { echo "=== $1 (t=$(($(date +%s) - t0))s)"; }
stage env
nvidia-smi -L 2>/dev/null
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
stage "demo (on the accelerator: JAX's default backend)"
timeout 180 python3 -m flatkv_jax demo 2>&1 | tee "$out/demo.log" | tail -22
stage vs_vllm
vllm_args=()
[ -f "$peer_dir/vllm.json" ] && vllm_args=(--vllm "$peer_dir/vllm.json")
timeout 240 python3 benchmarks/vs_vllm.py --platform gpu --batches 256 --repeats 1 \
  --peer "$peer_dir/vllm_kv_bench.py" "${vllm_args[@]}" --json "$out/vs_vllm.json" 2>&1 |
  tee "$out/vs_vllm.log" | grep -v "^compile"
stage coordinator
for flag in "" --no-prefix; do
  timeout 70 python3 benchmarks/coordinator.py --platform gpu --batch 256 --pages 16384 \
    --steps 200 $flag 2>&1 | tee -a "$out/coordinator.log" | tail -4
done
stage kernels
timeout 60 python3 benchmarks/kernels.py --platform gpu --impl reference 2>&1 |
  tee "$out/kernels.log" | tail -8
stage done
