"""``python -m fedfusion.datasets``: a device's own data file (``client-data='local'``).

* ``check FILE [--shape C,H,W] [--classes K]``: validate it as the ClientApp will, print its
  size and class histogram (exit 1 with the problem otherwise);
* ``demo FOLDER [--devices N] [--samples S] [--alpha A] [--val-size V] [--seed S]``: demo
  files ``device-<i>.npz`` cut from a built-in dataset (never the run's validation rows), for
  trying the mode (:func:`~fedfusion.datasets.local_file.write_demo_files`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from fedfusion.datasets.local_file import LocalDataError, read_local_data, write_demo_files


def main(argv: Sequence[str] | None = None) -> int:
    """Check a device's file, or write demo files; 0 on success, 1 with the problem."""
    import argparse

    from fedfusion.datasets.partition import class_histogram

    parser = argparse.ArgumentParser(prog="python -m fedfusion.datasets",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="device-<i>.npz demo files from a built-in dataset")
    p.add_argument("folder")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--samples", type=int, default=1000, help="images per device")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--alpha", type=float, default=None,
                   help="each device's own class mix, Dirichlet(alpha) (default: uniform)")
    p.add_argument("--val-size", type=int, default=500,
                   help="the run's val-size: its validation rows are left out of the files")
    p.add_argument("--seed", type=int, default=0,
                   help="the run's split-seed, or its seed when split-seed is -1 (the seed "
                        "of its validation rows)")
    p = sub.add_parser("check", help="validate a device's file; print its size and histogram")
    p.add_argument("path")
    p.add_argument("--shape", default="1,28,28", help="C,H,W of the run's dataset")
    p.add_argument("--classes", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            for path in write_demo_files(args.folder, args.devices, args.samples, args.dataset,
                                         args.data_dir, args.seed, args.alpha, args.val_size):
                with np.load(path, allow_pickle=False) as npz:  # the file just written
                    print(f"{path}: classes {np.bincount(npz['y']).tolist()}")
        else:
            shape = tuple(int(v) for v in args.shape.split(","))
            data = read_local_data(args.path, shape, args.classes)
            histogram = class_histogram(data.y, [np.arange(len(data.y))], args.classes)[0]
            print(f"{data.path}: {len(data.y)} images {list(data.x.shape[1:])}, "
                  f"classes {histogram.tolist()}")
    except (LocalDataError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
