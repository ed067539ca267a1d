#!/usr/bin/env bash
# Create (or confirm) the project environment in .venv and make Fashion-MNIST available.
# Idempotent: with the environment present and unchanged it returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${FEDFUSION_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.fedfusion-setup"
# torch and torchvision are pinned as a pair (a CUDA build that also runs on the CPU);
# nothing below may pull another torch.
PACKAGES=(
  "torch==2.14.1" "torchvision==0.29.1" "flwr[simulation]==1.41.0" "laplace-torch==0.3"
  "numpy>=1.26" "pytest>=8" "ruff>=0.6" "hatchling" "hypothesis==6.170.17"
  # optional: the flwr-dirichlet partitioner (Flower Datasets); tested, so installed here
  "flwr-datasets==0.6.1"
  # the example App of examples/digits (scikit-learn ships its data set), tested in CI
  "scikit-learn==1.9.1"
)
WANT="$(printf '%s\n' "${PACKAGES[@]}" | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import torch, torchvision, flwr, laplace" 2>/dev/null; then
  echo "setup: environment $VENV is up to date"
else
  echo "setup: creating $VENV (torch + CUDA libraries are about 6 GB; a few minutes)"
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "fedfusion needs Python >= 3.11 (flwr 1.41 requires it)"'
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install "${PACKAGES[@]}"
  "$VENV/bin/python" -c "import torch, torchvision; assert torch.__version__.startswith('2.14.1'), torch.__version__"
  echo "$WANT" > "$STAMP"
fi

# Fashion-MNIST: Debian's dataset-fashion-mnist where apt exists; else torchvision downloads it
# on first use (see README "Data").
FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$FMNIST" ] && [ -z "${FEDFUSION_DATA_DIR:-}" ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
  echo "setup: installing dataset-fashion-mnist with apt-get"
  if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist; }; then
    echo "setup: warning: apt-get could not install dataset-fashion-mnist;" \
         "the run will try torchvision's download (needs a network) or FEDFUSION_DATA_DIR" >&2
  fi
fi
