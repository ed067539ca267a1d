#!/usr/bin/env bash
# The library's tests at both ends of the version ranges it claims (pyproject.toml): the oldest
# end in a library-only environment (no Ray, no torchvision), the newest end with the App's
# packages too (flwr[simulation] 1.42 + torchvision), where the App's own `flwr run` tests
# also run. CI runs it after the suite (.ci/run). The environments live outside the checkout
# ($FEDFUSION_VERSION_ENVS, default ~/.cache/fedfusion/version-envs: each is ~6 GB of CUDA
# wheels) and are reused when they hold the same packages (a stamp file).
# A torch the registry lists but cannot resolve (torch 2.15.0 here: its CUDA wheels have no
# matching dependencies) is not claimed; the newest end is the newest that installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# everything that tests the library through its public API and needs neither `flwr run`
# nor the App's data sets
LIB_TESTS=(tests/accel/test_accel.py tests/examples/test_ams_toy.py tests/flower/test_client_errors.py
           tests/curvature/test_curvature.py tests/core/test_evaluation.py tests/curvature/test_fast_kron.py
           tests/wire/test_fuzz.py tests/strategies/test_gaussianity.py tests/wire/test_hostile_uploads.py
           tests/accel/test_kernels.py tests/test_layers.py tests/test_library.py
           tests/flower/test_node_sampling.py tests/wire/test_wire.py tests/strategies/test_real_models.py
           tests/test_side_effects.py tests/training/test_training.py)

# the App under the newest flwr: every `flwr run` path (launch, replay, Ray errors, interrupt)
APP_TESTS=(tests/app/test_e2e_flower.py tests/app/test_launch.py)
ENVS="${FEDFUSION_VERSION_ENVS:-$HOME/.cache/fedfusion/version-envs}"

run_end() {
  local name=$1 tests=$2; shift 2
  local venv="$ENVS/$name" packages=("$@" "laplace-torch==0.3" "pytest>=8"
                                     "hypothesis==6.170.17")
  local want; want="$(printf '%s\n' "${packages[@]}" | sha256sum | cut -c1-16)"
  if [ ! -f "$venv/.stamp" ] || [ "$(cat "$venv/.stamp")" != "$want" ]; then
    echo "test_versions: creating $venv (${packages[*]})"
    rm -rf "$venv"
    mkdir -p "$ENVS"
    "$PYTHON" -m venv "$venv"
    # pip's warnings (e.g. about this machine's package mirrors) go to a log, shown on failure
    if ! { "$venv/bin/python" -m pip install -q --upgrade pip &&
           "$venv/bin/python" -m pip install -q "${packages[@]}"; } > "$venv.pip.log" 2>&1; then
      tail -40 "$venv.pip.log"; exit 1
    fi
    echo "$want" > "$venv/.stamp"
  fi
  "$venv/bin/python" -c "import torch, flwr, numpy, scipy; from importlib.metadata import version as v; print('test_versions: $name: torch', torch.__version__, 'flwr', v('flwr'), 'numpy', numpy.__version__, 'scipy', scipy.__version__)"
  local -n selected=$tests
  OMP_NUM_THREADS=1 PYTHONPATH=. "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    "${selected[@]}"
}

BOTH_TESTS=("${LIB_TESTS[@]}" "${APP_TESTS[@]}")
ENDS=" ${*:-oldest newest} "  # e.g. `bash scripts/test_versions.sh newest` for one end
if [[ $ENDS == *" oldest "* ]]; then
  run_end oldest LIB_TESTS "torch==2.10.0" "flwr==1.40.0" "numpy==1.26.4" "scipy==1.13.1"
fi
if [[ $ENDS == *" newest "* ]]; then
  run_end newest BOTH_TESTS "torch==2.14.1" "torchvision==0.29.1" "flwr[simulation]==1.42.0" \
    "numpy" "scipy"
fi
