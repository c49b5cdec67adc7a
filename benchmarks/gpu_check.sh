#!/usr/bin/env bash
# The whole GPU picture in one call (under 8 minutes on one recent GPU): the CUDA tests, then
# the benchmark grid's main cells (bench_peers.py --grid main) on --device cuda with absolute
# times, into ${OUT}/grid_cuda.json (its tables and plot beside it).
#
#   bash benchmarks/gpu_check.sh                  # needs torch with CUDA and a GPU
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh     # where the JSON goes (default benchmarks/results)
#   DEVICE=cpu bash benchmarks/gpu_check.sh       # smoke test of the script on CPU (tiny grid)
#
# Installs nothing but the package itself (pip install -e .[test], only when it does not
# import). Every step runs under `timeout`; a step that fails or times out is reported in the
# summary and the script goes on. Exit status: 0 when every step passed.
set -u
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$OUT"
declare -a SUMMARY=()
status=0

step() { # step NAME SECONDS CMD...: run CMD under timeout, record its outcome
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    local what="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then what="TIMED OUT"; elif [ "$rc" -ne 0 ]; then what="FAILED (exit $rc)"; fi
    [ "$rc" -ne 0 ] && status=1
    SUMMARY+=("$name: $what in $((SECONDS - t0)) s")
}

if ! "$PY" -c "import multiscale_jac, pytest" 2>/dev/null; then
    step "install" 90 "$PY" -m pip install -q -e ".[test]"
fi
"$PY" - "$DEVICE" <<'EOF' || { echo "no usable torch / $1 device"; exit 2; }
import sys, torch
dev = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if dev == "cuda" and torch.cuda.is_available() else dev)
sys.exit(0 if dev == "cpu" or torch.cuda.is_available() else 1)
EOF

if [ "$DEVICE" = "cuda" ]; then
    # the CUDA-marked tests and those on the cuda_device fixture (their names say cuda)
    step "cuda tests" 120 "$PY" -m pytest -q -k cuda tests
    # the main cells, one per workload (zoo models and new architectures), absolute times;
    # --budget: no new cell after 200 s, so the step ends within its limit
    CELLS=(jacnorm/cnn8 fisher/resnet8 jacobian/resnet8 ragged/det_head subset/gelu_cnn
        laplace/transformer jacnorm/transformer fisher/gn_dw jacobian/det_head)
    step "grid main cuda" 260 "$PY" benchmarks/bench_peers.py --grid main --device cuda \
        --cells "${CELLS[@]}" --memory main --min-run-time 0.2 --method-limit 10 \
        --check-limit 15 --budget 200 --out "$OUT" --name grid_cuda
else # smoke test of this script on CPU: one tiny cell
    step "grid main $DEVICE (smoke)" 300 "$PY" benchmarks/bench_peers.py --grid main \
        --device "$DEVICE" --quick --cells jacnorm/gelu_cnn --memory none --min-run-time 0.05 \
        --method-limit 5 --out "$OUT" --name "grid_${DEVICE}_smoke"
fi

echo
echo "== summary ($DEVICE, results in $OUT)"
printf '  %s\n' "${SUMMARY[@]}"
exit $status
