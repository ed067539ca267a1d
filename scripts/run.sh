#!/usr/bin/env bash
# Set everything up, then run the default job: one-shot FedAvg on Fashion-MNIST, LeNet,
# 5 clients (Dirichlet alpha 0.1), 20 local epochs, on Flower's Ray simulation backend.
# Extra arguments are run-config overrides, e.g.: bash scripts/run.sh "strategy=ensemble alpha=0.4"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m fedfusion.app.launch --run-config "${1:-}"
