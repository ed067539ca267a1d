"""Replay cached client uploads into any strategy, without Flower and without training.

``python -m fedfusion.app.replay UPLOAD_DIR --strategy ensemble [--run-config "k=v ..."]``

The upload folder is the ``uploads/`` of a one-shot run with ``save-uploads=true``. Data
and model settings come from its manifest; the strategy and server-side keys come from the
command line. Results are written exactly as for a live run. The same works inside Flower:
``flwr run . --run-config "replay='UPLOAD_DIR' strategy='ensemble'"``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

from fedfusion.app.config import ConfigError, Settings
from fedfusion.server_app import run_server

APP_DIR = Path(__file__).resolve().parents[2]


def parse_run_config(text: str) -> dict[str, Any]:
    """Parse ``"k=v k2='s'"`` with TOML value typing, as ``flwr run --run-config`` does."""
    values: dict[str, Any] = {}
    for item in shlex.split(text, posix=False):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"run-config item {item!r} is not key=value")
        try:
            values[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = value  # a bare string
    return values


def replay(upload_dir: str, strategy: str, run_config: str = "") -> dict[str, Any]:
    values = {**parse_run_config(run_config), "strategy": strategy, "replay": str(upload_dir)}
    return run_server(Settings.from_mapping(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upload_dir")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--run-config", default="", help="e.g. \"output-dir='out' seed=0\"")
    args = parser.parse_args(argv)
    try:
        replay(args.upload_dir, args.strategy, args.run_config)
    except Exception as exc:  # a bad folder or run config ends in one line, not a traceback
        print(f"fedfusion.app.replay: {one_line(exc)}", file=sys.stderr)
        # 2: the input is at fault (config, folder, no valid upload); 1: anything else
        expected = isinstance(exc, ConfigError | OSError | ValueError | RuntimeError)
        return 2 if expected else 1
    return 0


def one_line(exc: BaseException, limit: int = 2000) -> str:
    """``exc`` as one line: its message's lines joined, clipped, typed unless a ValueError
    (whose messages here always say what is wrong)."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not isinstance(exc, ValueError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    sys.exit(main())
