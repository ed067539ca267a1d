#!/usr/bin/env bash
# Prepare, on this machine, what the GPU checks need on a lent device machine, which reaches no
# package registry: wheels for its Python, the FMNIST IDX files, the authors' split and the
# FedBEns authors' code. Everything lands in .device/ (git-ignored), in two folders of under
# 64 MiB each, one per device call (benchmarks/README.md, "On a lent GPU machine"):
#   .device/clients  check.sh clients: our wheels, the authors' pins and code, the data
#   .device/scale    check.sh scale:   flwr run's remaining wheels and a slimmed ray
#
#   bash benchmarks/device/prepare.sh AUTHORS_GIT_DIR   # a clone of github jacopot96/FedBEns
# Env: PYVER (default 3.12, the device's Python; 3.11 to try the set-up here), FMNIST (default
# /usr/share/datasets/fashion-mnist), SPLITS (default ../shared/data/fedbens-authors-splits.npz).
# Idempotent: what is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
AUTHORS_GIT=${1:?usage: prepare.sh AUTHORS_GIT_DIR (a clone of jacopot96/FedBEns)}
AUTHORS_COMMIT=b2c9813
PYVER=${PYVER:-3.12}
FMNIST=${FMNIST:-/usr/share/datasets/fashion-mnist}
SPLITS=${SPLITS:-../shared/data/fedbens-authors-splits.npz}
RAY=ray==2.55.1
HERE=benchmarks/device
PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)

wheels() {  # wheels LIST DEST: every pin of LIST, for the device's Python, without dependencies
  mkdir -p "$2"
  grep -v '^#' "$1" | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" -d "$2"
}

echo "wheels for Python $PYVER ..."
wheels $HERE/wheels-ours.txt .device/clients/wheels/ours
wheels $HERE/wheels-authors.txt .device/clients/wheels/authors
wheels $HERE/wheels-simulation.txt .device/scale/wheels

echo "data ..."
mkdir -p .device/clients/data
[ -f .device/clients/data/fmnist.tar.xz ] || {
  raw=$(mktemp -d)
  for f in "$FMNIST"/*-ubyte.gz; do gzip -dc "$f" > "$raw/$(basename "$f" .gz)"; done
  tar cf - -C "$raw" . | xz -9 -T0 > .device/clients/data/fmnist.tar.xz
  rm -r "$raw"
}
cp -f "$SPLITS" .device/clients/data/

echo "the authors' code at $AUTHORS_COMMIT ..."
rm -rf .device/clients/authors && mkdir -p .device/clients/authors
git -C "$AUTHORS_GIT" archive "$AUTHORS_COMMIT" One_shot_FL \
  | tar x -C .device/clients/authors --exclude='*.pyc' --exclude='__pycache__'

echo "ray, slimmed ..."
slim=.device/scale/ray-slim.tar.xz
[ -f $slim ] || {
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${PLATFORMS[@]}" -d "$work" $RAY
  (cd "$work" && unzip -q ray-*.whl && rm ray-*.whl
   # Java, RLlib, LLM serving and the dashboard's web client: nothing Flower's backend loads
   rm -rf ray/jars ray/rllib ray/llm ray/dashboard/client/build
   strip --strip-unneeded ray/_raylet.so ray/core/src/ray/raylet/raylet \
     ray/core/src/ray/gcs/gcs_server)
  tar cf - -C "$work" . | xz -9 -T0 > $slim
  rm -r "$work"
}
du -sh .device/clients .device/scale
