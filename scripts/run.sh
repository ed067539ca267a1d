#!/usr/bin/env bash
# Set everything up, then run the default job: one live FedBEns round on Fashion-MNIST (LeNet,
# 5 clients, Dirichlet alpha 0.1) through Flower's Ray simulation backend, its uploads
# replayed into FedAvg, the uniform ensemble, FENS and FENS distilled into one network, and a
# table by inference budget (python -m fedfusion.app.compare). With an argument, one run with
# those run-config overrides instead, e.g.: bash scripts/run.sh "strategy=ensemble alpha=0.4"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${1:-}" ]; then
  exec .venv/bin/python -m fedfusion.app.compare
fi
exec .venv/bin/python -m fedfusion.app.launch --run-config "$1"
