#!/usr/bin/env bash
# Issue 40's GPU checks, run ON a lent GPU machine through the device tool, from what
# prepare.sh put in .device/. Two parts, one device call each, back to back on one warm machine
# (the second reuses what the first installed and unpacked):
#   check.sh clients   carry .device/clients   GPU tests; FedBEns ours vs the authors' code
#                                              on one card (benchmarks/gpu_end_to_end.py)
#   check.sh scale     carry .device/scale     the server on CPU vs GPU at C = 100 with the
#                                              defaults (server_device.py; CELLS, VARIANTS);
#                                              SCALE_RUN=1 first runs C = 100, M = 5 through flwr
#                                              run with the clients on the card (scale.py gpu;
#                                              done on 2026-11-28), whose uploads it then fuses
# Logs and JSON go to $OUT, which the device tool brings back; copy the JSON into
# benchmarks/results/ here. IMAGE_PYTHON (default python3: the image's, holding torch) is left
# as it is: the wheels go into a venv of ours that sees the image's packages behind its own.
# DRY_RUN=1 tries the same set-up on a machine without a GPU: one local epoch on the CPU, a
# 3-client flwr run instead of the C = 100 one, the server at C = 3 on the CPU alone.
# DEADLINE_S (default 500) bounds the side-by-side runs of 'clients' (gpu_end_to_end.py
# --deadline-s: none starts past it, one still running at it is stopped and recorded as
# unfinished). ALPHAS (default 0.1,0.4): the side-by-side cells; CELLS (default 100): the server's client
# counts (5 and 40 were measured on 2026-11-26/28; the C = 100 row with the defaults never
# fitted a lease before). On 2026-11-28 the authors' code ran over 380 s at alpha 0.1 on an
# H200, so one lease holds one alpha's pair, and 'scale' only with what is left
# (benchmarks/docs/gpu.md, "The next lease").
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:?usage: check.sh clients|scale}
OUT=${OUT:-/tmp/fedfusion-device-out}
IMAGE_PY=${IMAGE_PYTHON:-python3}
VENV=/tmp/fedfusion-venv PY=/tmp/fedfusion-venv/bin/python
FMNIST_DIR=/tmp/fedfusion-fmnist
export PYTHONUNBUFFERED=1 FEDFUSION_DATA_DIR=$FMNIST_DIR
mkdir -p "$OUT"
failed=""  # the steps that failed: the script's exit status says so at the end
quiet() { grep -v -E "fedfusion client [0-9]+ member|^\s*$" || true; }  # per-member lines

make_venv() {  # ours, its site-packages first, then the image's (a .pth file): torch and co.
  [ -x $PY ] && return
  $IMAGE_PY -m venv --without-pip $VENV || exit 1
  $IMAGE_PY -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
    > "$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image.pth"
}

install_clients() {  # our wheels into our venv; the authors' pins apart; the data
  [ -d .device/clients ] || { echo "no .device/clients here: run 'check.sh clients' (carry" \
    ".device/clients) on this machine first"; exit 2; }
  make_venv
  # --ignore-installed: into our venv even where the image (or a dry run's) has them, so that
  # their scripts (flwr) are ours too
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --ignore-installed \
    .device/clients/wheels/ours/*.whl || exit 1
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target \
    /tmp/authors-site .device/clients/wheels/authors/*.whl || exit 1
  mkdir -p $FMNIST_DIR && tar xJf .device/clients/data/fmnist.tar.xz -C $FMNIST_DIR
}

case $PART in
clients)
  start=$(date +%s)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  install_clients
  echo "installed in $(( $(date +%s) - start )) s"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    | tee -a "$OUT/gpu.txt"
  # the tests that skip without a GPU, and the device choice and the vmapped engine; the
  # server's in a process of its own (a capture that fails marks its process: torch < 2.12
  # can leave the allocator's capture state behind)
  { $PY -m pytest -q -p no:cacheprovider tests/accel/test_vmapped.py \
      tests/app/test_client_device.py || failed+=" gpu-tests"
    $PY -m pytest -q -p no:cacheprovider tests/strategies/test_server_gpu.py \
      || failed+=" server-gpu-tests"; } > "$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -6
  dry=() alphas=${ALPHAS:-0.1,0.4}
  [ "${DRY_RUN:-0}" = 1 ] && dry=(--cpu --epochs 1) alphas=${ALPHAS:-0.1}
  $PY benchmarks/gpu_end_to_end.py "${dry[@]}" --authors-code .device/clients/authors/One_shot_FL \
    --data-dir $FMNIST_DIR --splits .device/clients/data/fedbens-authors-splits.npz \
    --authors-site /tmp/authors-site --deadline-s "${DEADLINE_S:-500}" --alphas "$alphas" \
    --json "$OUT/gpu_end_to_end.json" \
    > "$OUT/gpu_end_to_end.log" 2>&1 || failed+=" gpu_end_to_end"
  quiet < "$OUT/gpu_end_to_end.log" | tail -40
  ;;
scale)
  [ -x $VENV/bin/flwr ] || install_clients
  [ -f $FMNIST_DIR/train-images-idx3-ubyte ] || install_clients
  if [ "${DRY_RUN:-0}" = 1 ] || [ "${SCALE_RUN:-0}" = 1 ]; then  # flwr run's Ray simulation
    site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    $PY -m pip install -q --no-index --no-deps --no-cache-dir --ignore-installed \
      .device/scale/wheels/*.whl || exit 1
    tar xJf .device/scale/ray-slim.tar.xz -C "$site" || exit 1
  fi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    uploads=outputs/device-dry-run/c3/uploads cells=3
    $PY -c "from fedfusion.app.launch import launch; r = launch(\"strategy=fedbens \
num-clients=3 num-members=2 local-epochs=1 train-subset=1200 output-dir='outputs/device-dry-run' \
run-name=c3\"); print('dry run:', r['status'], r['test']['accuracy'])" \
      > "$OUT/scale-gpu.log" 2>&1 || failed+=" dry-run"
    quiet < "$OUT/scale-gpu.log" | tail -5
  elif [ "${SCALE_RUN:-0}" = 1 ]; then
    uploads=outputs/bench-scale/c100_m5_s0_gpu/uploads cells=${CELLS:-100}
    $PY benchmarks/scale.py gpu > "$OUT/scale-gpu.log" 2>&1 && cp benchmarks/results/scale.json \
      "$OUT/" || failed+=" scale-gpu"
    quiet < "$OUT/scale-gpu.log" | tail -30
  else  # the server trains the same C = 100 set itself, with 15 processes (no Ray, faster)
    uploads=outputs/none cells=${CELLS:-100}
  fi
  rm -f benchmarks/results/server_device.json  # only a fresh one goes back (saved row by row)
  timeout 300 $PY benchmarks/server_device.py --cells $cells --uploads $uploads \
    --variants "${VARIANTS:-cpu defaults,gpu defaults}" \
    > "$OUT/server-device.log" 2>&1 || failed+=" server_device"
  cp benchmarks/results/server_device.json "$OUT/" 2>/dev/null
  tail -30 "$OUT/server-device.log"
  ;;
*)
  echo "check.sh: unknown part '$PART' (clients or scale)"; exit 2 ;;
esac
[ -z "$failed" ] || { echo "check.sh $PART: FAILED:$failed (logs in $OUT)"; exit 1; }
echo "check.sh $PART: every step passed"
