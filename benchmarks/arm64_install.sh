#!/usr/bin/env bash
# An ARM64 (aarch64) Debian userland on an x86-64 host, emulated by qemu-user through
# binfmt_misc, with a device's Python environment for a fedfusion SuperNode: what
# benchmarks/arm64_supernode.py runs its ARM64 SuperNode in.
#
#   sudo bash benchmarks/arm64_install.sh [ROOT]        # ROOT defaults to /srv/arm64
#
# Needs root (debootstrap, mount, chroot) and the network (a Debian mirror, PyPI). Every step
# is printed before it runs, timed, and appended as one JSON line {"step", "command",
# "seconds"} to ROOT/root/fedfusion-install.jsonl; a step already done (its marker file
# exists) is skipped, so the script can be rerun after an interruption, and it (re)mounts
# /proc, /sys and /dev in ROOT. The release is the host's (VERSION_CODENAME of
# /etc/os-release), so the chroot's Python is the host distribution's.
set -euo pipefail

ROOT=${1:-/srv/arm64}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
RELEASE=$(. /etc/os-release && echo "$VERSION_CODENAME")
ENV=/opt/fedfusion-env
LOG=$ROOT/root/fedfusion-install.jsonl
# torch 2.10.0, not the project's 2.14.1: PyPI's aarch64 wheels of torch 2.11 and later are
# CUDA 13 builds (454 MB for 2.14.1) that require the CUDA wheels on every Linux machine
# (cuda-toolkit, nvidia-cudnn-cu13, nccl, nvshmem, triton: gigabytes, useless on a device
# without an NVIDIA GPU, and the import fails without them); 2.10.0 is the newest CPU-only one
# (146 MB; its CUDA requirements are for x86_64 only). TORCH=torch==2.14.1 installs the CUDA
# build with all of that; the PyTorch CPU index (--index-url https://download.pytorch.org/whl/cpu)
# is where CPU builds are published, but it is unreachable here and was not checked.
TORCH=${TORCH:-torch==2.10.0}
FLWR=${FLWR:-flwr==1.41.0}

[ "$(id -u)" = 0 ] || { echo "arm64_install.sh: must run as root" >&2; exit 1; }

# inside ROOT: a clean environment (no host pip config or paths); the network is the host's
# (a chroot shares its network namespace)
in_root() {
    chroot "${ROOT:?}" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 OMP_NUM_THREADS=1 "$@"
}

# step NAME MARKER COMMAND: run the shell COMMAND (in_root available) unless MARKER exists;
# log COMMAND and its wall time
step() {
    local name=$1 marker=$2 command=$3 t0 t1
    if [ -e "$marker" ]; then echo "== $name: already done ($marker)"; return; fi
    echo "== $name: + $command"
    t0=$(date +%s.%N)
    ROOT=$ROOT bash -c "$(declare -f in_root); set -e; $command"
    t1=$(date +%s.%N)
    mkdir -p "$(dirname "$LOG")"
    python3 -c '
import json, sys
name, t0, t1, log, command = sys.argv[1:]
with open(log, "a") as f:
    f.write(json.dumps({"step": name, "command": command,
                        "seconds": round(float(t1) - float(t0), 1)}) + "\n")
print(f"== {name}: {float(t1) - float(t0):.1f} s")
' "$name" "$t0" "$t1" "$LOG" "$command"
}

mount_once() {  # mount_once MOUNT-ARGS... DEST
    mountpoint -q "${!#}" || mount "$@"
}

# qemu-user-static registers qemu-aarch64 with binfmt_misc (flag F: the interpreter is
# opened at registration, so nothing has to be copied into the chroot)
command -v debootstrap > /dev/null && command -v qemu-aarch64-static > /dev/null ||
    step apt-host /nonexistent-marker "apt-get update -q && DEBIAN_FRONTEND=noninteractive \
apt-get install -y -q debootstrap qemu-user-static binfmt-support"
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

step debootstrap-first "$ROOT/etc/fedfusion-first-stage" \
    "debootstrap --arch=arm64 --variant=minbase --foreign $RELEASE $ROOT $MIRROR \
&& touch $ROOT/etc/fedfusion-first-stage"
# the second stage runs the packages' maintainer scripts: arm64 code, emulated
step debootstrap-second "$ROOT/etc/fedfusion-second-stage" \
    "chroot $ROOT /debootstrap/debootstrap --second-stage && touch $ROOT/etc/fedfusion-second-stage"

cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
mount_once -t proc proc "$ROOT/proc"
mount_once -t sysfs sysfs "$ROOT/sys"
mount_once --bind /dev "$ROOT/dev"
mount_once --bind /dev/pts "$ROOT/dev/pts"
# pip trusts the host's CA bundle: the Debian CAs plus any local CA the host's network needs
# (a TLS-inspecting proxy, as here); apt above fetches over plain HTTP with signed indexes
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/host-ca-certificates.crt"
PIP="$ENV/bin/pip install --cert /etc/ssl/host-ca-certificates.crt --no-compile --progress-bar off"

step apt-python "$ROOT/usr/lib/python3/dist-packages/pip" \
    "in_root sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
--no-install-recommends python3 python3-venv python3-pip ca-certificates'"
step venv "$ROOT$ENV/.venv-done" "rm -rf $ROOT$ENV && in_root python3 -m venv $ENV \
&& touch $ROOT$ENV/.venv-done"
# --no-compile: byte-compiling every module of the wheels (thousands of torch's) is emulated
# Python, far slower than the download; Python compiles (and caches) what it imports instead
step pip-torch "$ROOT$ENV/.torch-done" "in_root $PIP $TORCH && touch $ROOT$ENV/.torch-done"
# scipy: the App's run config imports the strategy registry (its assignment solver)
step pip-flwr "$ROOT$ENV/.flwr-done" \
    "in_root $PIP $FLWR numpy scipy && touch $ROOT$ENV/.flwr-done"
in_root "$ENV/bin/python" -c 'import platform, torch, flwr, numpy, scipy
print(platform.machine(), torch.__version__, flwr.__version__, numpy.__version__,
      scipy.__version__)'
echo "== done: $LOG"
