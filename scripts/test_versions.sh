#!/usr/bin/env bash
# The library's tests at both ends of the version ranges it claims (pyproject.toml), each in a
# library-only environment (.venv-lib-oldest, .venv-lib-newest: no App pins, no Ray, no
# torchvision). Idempotent: an environment that exists with the same packages is reused.
# A torch the registry lists but cannot resolve (torch 2.15.0 here: its CUDA wheels have no
# matching dependencies) is not claimed; the newest end is the newest that installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# everything that tests the library through its public API and needs neither `flwr run`
# nor the App's data sets
LIB_TESTS=(tests/test_accel.py tests/test_ams_toy.py tests/test_client_errors.py
           tests/test_curvature.py tests/test_evaluation.py tests/test_fast_kron.py
           tests/test_fuzz.py tests/test_gaussianity.py tests/test_hostile_uploads.py
           tests/test_kernels.py tests/test_layers.py tests/test_library.py
           tests/test_node_sampling.py tests/test_wire.py tests/test_real_models.py
           tests/test_side_effects.py tests/test_training.py)

run_end() {
  local name=$1; shift
  local venv=".venv-lib-$name" packages=("$@" "laplace-torch==0.3" "pytest>=8"
                                          "hypothesis==6.170.17")
  local want; want="$(printf '%s\n' "${packages[@]}" | sha256sum | cut -c1-16)"
  if [ ! -f "$venv/.stamp" ] || [ "$(cat "$venv/.stamp")" != "$want" ]; then
    echo "test_versions: creating $venv (${packages[*]})"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "${packages[@]}"
    echo "$want" > "$venv/.stamp"
  fi
  "$venv/bin/python" -c "import torch, flwr, numpy, scipy; from importlib.metadata import version as v; print('test_versions: $name: torch', torch.__version__, 'flwr', v('flwr'), 'numpy', numpy.__version__, 'scipy', scipy.__version__)"
  OMP_NUM_THREADS=1 PYTHONPATH=. "$venv/bin/python" -m pytest -q -p no:cacheprovider "${LIB_TESTS[@]}"
}

run_end oldest "torch==2.10.0" "flwr==1.40.0" "numpy==1.26.4" "scipy==1.13.1"
run_end newest "torch==2.14.1" "flwr==1.42.0" "numpy" "scipy"
