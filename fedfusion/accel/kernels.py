"""Small compiled CPU kernels for the stacked trainer (:mod:`fedfusion.accel.stacked`).

At the sizes of the zoo's small models (LeNet: 1 -> 6 -> 16 channels) PyTorch's CPU kernels
are far from the arithmetic peak. The plain C loops here, with every size a compile-time
constant so that the compiler keeps the accumulators in vector registers, do the same work
in a fraction of the time (benchmarks/docs/throughput.md).

The C source is generated from the layer's sizes (integers only), compiled once per machine
with the system C compiler (``$CC``, else ``cc``) into a per-user cache folder (mode 0700,
:func:`private_cache_dir`) and loaded with ``ctypes`` only after its SHA-256 matches the one
recorded when it was built: no torch headers, so a compile takes ~0.5 s. Only code that asked
for :mod:`fedfusion.accel` gets here. Everything is optional: without a
compiler (or with ``FEDFUSION_NO_KERNELS=1``) the getters return None and the stacked trainer
uses its PyTorch ops instead. The kernels are single-threaded and deterministic; their float
summation order differs from PyTorch's, so results agree to float tolerance, not bitwise
(except the SGD step's, which has no sums).

Layout: every map is per-member NCHW, ``[M, B, C, H, W]`` contiguous, float32. Kernels:
the forward pass and weight gradient of a direct convolution (:func:`conv_kernels`), and a
2x2 max-pool with an optional ReLU, forward and backward (:func:`pool_kernels`), and the
input gradient of a convolution where its accumulators fit in registers
(:func:`input_grad_block`), and SGD's momentum step in one pass (:func:`sgd_kernel`, bit for
bit PyTorch's, checked when loaded).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("fedfusion")

DISABLE_ENV = "FEDFUSION_NO_KERNELS"
CACHE_ENV = "FEDFUSION_KERNEL_CACHE"
_FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared")
#: vector accumulators the input gradient may keep: ``[CB, KW, WO]`` partial rows (the
#: fastest block on LeNet's second layer; benchmarks/docs/throughput.md)
_IGRAD_REGISTERS = 12
#: vector accumulators a convolution kernel may keep (AVX2 has 16 registers; a few spills
#: cost less than splitting the output channels into blocks, which reloads every input row
#: per block)
_ACC_REGISTERS = 18
_FLOATS_PER_VECTOR = 8

_POOL_SOURCE = r"""
/* 2x2 max-pool, stride 2, over `planes` maps of h x w floats; arg (0..3) is the first
   maximum in row-major window order, as PyTorch's max_pool2d picks it; with relu the
   output is max(0, max) and arg is -1 (no gradient) where the maximum is <= 0.
   Written so that the compiler vectorizes it: selects of one type, int arithmetic on the
   comparisons (a version with `?:` on mixed types compiled to branches, 10x slower). */
void pool2_fwd(const float* restrict a, float* restrict out, int* restrict arg,
               long planes, long h, long w, int relu) {
  const long p = h / 2, q = w / 2;
  for (long n = 0; n < planes; n++) {
    const float* src = a + n * h * w;
    for (long i = 0; i < p; i++) {
      const float* r0 = src + 2 * i * w;
      const float* r1 = r0 + w;
      float* d = out + (n * p + i) * q;
      int* s = arg + (n * p + i) * q;
      for (long j = 0; j < q; j++) {
        const float v00 = r0[2 * j], v01 = r0[2 * j + 1], v10 = r1[2 * j], v11 = r1[2 * j + 1];
        const int top = v01 > v00, bottom = v11 > v10;
        const float t = v01 > v00 ? v01 : v00, b = v11 > v10 ? v11 : v10;
        const int down = b > t;
        s[j] = top + down * (2 + bottom - top);
        d[j] = b > t ? b : t;
      }
      if (relu)
        for (long j = 0; j < q; j++) {
          const int pass = d[j] > 0.0f;
          s[j] = pass * (s[j] + 1) - 1;
          d[j] = d[j] > 0.0f ? d[j] : 0.0f;
        }
    }
  }
}

/* gradient of pool2_fwd: grad_in is overwritten (zero except at the chosen maxima).
   A zeroing pass, then one store per window, without branches: where arg is -1 it stores
   a zero into corner 3, which the zeroing pass already holds (the faster of the variants
   measured; branches on the choices, which are coin flips, were 5x slower). */
void pool2_bwd(const float* restrict g, const int* restrict arg, float* restrict grad_in,
               long planes, long h, long w) {
  const long p = h / 2, q = w / 2;
  for (long k = 0; k < planes * h * w; k++) grad_in[k] = 0.0f;
  for (long n = 0; n < planes; n++) {
    float* dst = grad_in + n * h * w;
    const float* src = g + n * p * q;
    const int* sel = arg + n * p * q;
    for (long i = 0; i < p; i++)
      for (long j = 0; j < q; j++) {
        const int k = sel[i * q + j];
        const int corner = k & 3;
        dst[(2 * i + (corner >> 1)) * w + 2 * j + (corner & 1)] =
            src[i * q + j] * (float)(k >= 0);
      }
  }
}
"""


def _conv_source(c: int, o: int, h: int, w: int, kh: int, kw: int) -> str:
    """Direct convolution (stride 1, no padding) forward and weight gradient for
    ``[M, B, C, H, W]`` maps and ``[M, O, C, KH, KW]`` weights, all sizes but M and B fixed.

    The forward pass keeps a ``[RB, FOB, WO]`` block of output rows in registers while it
    runs over the reduction (:func:`forward_block`); the weight gradient keeps ``[OB, WO]``
    partial sums per kernel tap.
    The input gradient (where :func:`input_grad_block` allows it) visits each input row
    ``r`` once per block of ``CB`` input channels and keeps, per channel and kernel column
    ``kj``, the partial row ``sum_{o, ki} w[o, c, ki, kj] g[o, r - ki, :]`` in registers: only
    the multiply-adds with real output-gradient rows, every output-gradient row loaded once
    per block; the ``KW`` partial rows are then added into the input row at offsets ``kj``."""
    ho, wo = h - kh + 1, w - kw + 1
    for name, value in (("c", c), ("o", o), ("h", h), ("w", w), ("kh", kh), ("kw", kw),
                        ("ho", ho), ("wo", wo)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"convolution kernel size {name} must be a positive int, got "
                             f"{value!r}")
    ob = _block(o, wo)
    fob, rb = forward_block(o, ho, wo)
    cb = input_grad_block(c, kw, wo) or 1
    return rf"""
#define C_ {c}
#define O_ {o}
#define H_ {h}
#define W_ {w}
#define KH {kh}
#define KW {kw}
#define HO {ho}
#define WO {wo}
#define OB {ob}
#define FOB {fob}
#define RB {rb}
#define CB {cb}

/* out[m,b,o,i,j] = bias[m,o] + sum_{{c,ki,kj}} w[m,o,c,ki,kj] x[m,b,c,i+ki,j+kj] */
void conv_fwd(const float* restrict x, const float* restrict wt, const float* restrict bias,
              float* restrict out, long members, long batch) {{
  for (long m = 0; m < members; m++)
    for (long b = 0; b < batch; b++) {{
      const float* xb = x + (m * batch + b) * C_ * H_ * W_;
      const float* wm = wt + m * O_ * C_ * KH * KW;
      float* ob_ = out + (m * batch + b) * O_ * HO * WO;
      for (int i = 0; i < HO; i += RB)
        for (int o0 = 0; o0 < O_; o0 += FOB) {{
          float acc[RB][FOB][WO];
          for (int r = 0; r < RB; r++)
            for (int o = 0; o < FOB; o++) {{
              const float init = bias ? bias[m * O_ + o0 + o] : 0.0f;
              for (int j = 0; j < WO; j++) acc[r][o][j] = init;
            }}
          for (int c = 0; c < C_; c++)
            for (int ki = 0; ki < KH; ki++) {{
              const float* xr = xb + (c * H_ + i + ki) * W_;
              for (int kj = 0; kj < KW; kj++)
                for (int o = 0; o < FOB; o++) {{
                  const float wv = wm[(((o0 + o) * C_ + c) * KH + ki) * KW + kj];
                  for (int r = 0; r < RB; r++)
                    for (int j = 0; j < WO; j++) acc[r][o][j] += wv * xr[r * W_ + j + kj];
                }}
            }}
          for (int r = 0; r < RB; r++)
            for (int o = 0; o < FOB; o++)
              for (int j = 0; j < WO; j++) ob_[((o0 + o) * HO + i + r) * WO + j] = acc[r][o][j];
        }}
    }}
}}

/* dw[m,o,c,ki,kj] = sum_{{b,i,j}} g[m,b,o,i,j] x[m,b,c,i+ki,j+kj] */
void conv_wgrad(const float* restrict x, const float* restrict g, float* restrict dw,
                long members, long batch) {{
  for (long m = 0; m < members; m++)
    for (int c = 0; c < C_; c++)
      for (int ki = 0; ki < KH; ki++)
        for (int kj = 0; kj < KW; kj++)
          for (int o0 = 0; o0 < O_; o0 += OB) {{
            float acc[OB][WO];
            for (int o = 0; o < OB; o++)
              for (int j = 0; j < WO; j++) acc[o][j] = 0.0f;
            for (long b = 0; b < batch; b++) {{
              const float* xb = x + ((m * batch + b) * C_ + c) * H_ * W_;
              const float* gb = g + ((m * batch + b) * O_ + o0) * HO * WO;
              for (int i = 0; i < HO; i++) {{
                const float* xr = xb + (i + ki) * W_ + kj;
                for (int o = 0; o < OB; o++)
                  for (int j = 0; j < WO; j++) acc[o][j] += gb[(o * HO + i) * WO + j] * xr[j];
              }}
            }}
            for (int o = 0; o < OB; o++) {{
              float s = 0.0f;
              for (int j = 0; j < WO; j++) s += acc[o][j];
              dw[((((m * O_) + o0 + o) * C_ + c) * KH + ki) * KW + kj] = s;
            }}
          }}
}}

/* gi[m,b,c,r,s] = sum_{{o,ki,kj}} w[m,o,c,ki,kj] g[m,b,o,r-ki,s-kj] (valid indices only) */
void conv_igrad(const float* restrict g, const float* restrict wt, float* restrict gi,
                long members, long batch) {{
  for (long m = 0; m < members; m++) {{
    const float* wm = wt + m * O_ * C_ * KH * KW;
    for (long b = 0; b < batch; b++) {{
      const float* gb = g + (m * batch + b) * O_ * HO * WO;
      float* gib = gi + (m * batch + b) * C_ * H_ * W_;
      for (int c0 = 0; c0 < C_; c0 += CB)
        for (int r = 0; r < H_; r++) {{
          float acc[CB][KW][WO];
          for (int cc = 0; cc < CB; cc++)
            for (int kj = 0; kj < KW; kj++)
              for (int j = 0; j < WO; j++) acc[cc][kj][j] = 0.0f;
          const int lo = r - HO + 1 > 0 ? r - HO + 1 : 0;
          const int hi = r < KH - 1 ? r : KH - 1;
          for (int ki = lo; ki <= hi; ki++)
            for (int o = 0; o < O_; o++) {{
              const float* grow = gb + (o * HO + r - ki) * WO;
              const float* wk = wm + ((o * C_ + c0) * KH + ki) * KW;
              float gv[WO];
              for (int j = 0; j < WO; j++) gv[j] = grow[j];
              /* unrolled so that the accumulators stay in registers (2x faster, measured) */
              #pragma GCC unroll 16
              for (int cc = 0; cc < CB; cc++)
                #pragma GCC unroll 16
                for (int kj = 0; kj < KW; kj++) {{
                  const float wv = wk[cc * KH * KW + kj];
                  #pragma GCC unroll 16
                  for (int j = 0; j < WO; j++) acc[cc][kj][j] += wv * gv[j];
                }}
            }}
          for (int cc = 0; cc < CB; cc++) {{
            float row[W_];
            for (int s = 0; s < W_; s++) row[s] = 0.0f;
            for (int kj = 0; kj < KW; kj++)
              for (int j = 0; j < WO; j++) row[kj + j] += acc[cc][kj][j];
            float* dst = gib + ((c0 + cc) * H_ + r) * W_;
            for (int s = 0; s < W_; s++) dst[s] = row[s];
          }}
        }}
    }}
  }}
}}

"""


def _vectors(width: int) -> int:
    """Vector registers a row of ``width`` floats takes."""
    return -(-width // _FLOATS_PER_VECTOR)


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (0 when ``at_most`` < 1)."""
    return max((d for d in range(1, min(n, at_most) + 1) if n % d == 0), default=0)


def _block(channels: int, width: int) -> int:
    """The largest divisor of ``channels`` whose ``[block, width]`` accumulators fit in
    :data:`_ACC_REGISTERS` vector registers (at least 1)."""
    return _largest_divisor(channels, max(1, _ACC_REGISTERS // _vectors(width)))


def forward_block(out_channels: int, out_height: int, out_width: int) -> tuple[int, int]:
    """(output channels, output rows) the compiled forward pass computes at once: two rows of
    half the channels where the rows pair up and that fits in 16 vector registers (each
    weight then serves two rows), else one row of :func:`_block` channels."""
    half = out_channels // 2
    if out_channels % 2 == 0 and out_height % 2 == 0 and 2 * half * _vectors(out_width) <= 16:
        return half, 2
    return _block(out_channels, out_width), 1


def input_grad_block(in_channels: int, kernel_width: int, out_width: int) -> int:
    """The input channels the compiled input gradient handles at once: the largest divisor
    of ``in_channels`` whose ``[block, kernel_width, out_width]`` accumulators fit in
    :data:`_IGRAD_REGISTERS` vector registers, or 0 when not even one channel's do (the
    stacked trainer then takes PyTorch's input gradient)."""
    return _largest_divisor(in_channels,
                            _IGRAD_REGISTERS // (kernel_width * _vectors(out_width)))


def one_block(out_channels: int, out_width: int) -> bool:
    """Whether the compiled convolution keeps all output channels in one register block
    (each input row loaded once): where it does, its forward and weight gradient match or
    beat oneDNN (LeNet's layers); where it does not (the CNN's), oneDNN is 1.5-4x faster."""
    return _block(out_channels, out_width) == out_channels


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "fedfusion" / "kernels"


def private_cache_dir() -> Path:
    """The kernel cache, created with mode 0700; an existing one must belong to this user
    and be closed to others (a shared library loaded from a folder someone else can write is
    their code in this process). Raises ``PermissionError`` naming the problem."""
    folder = _cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PermissionError(f"kernel cache {folder} belongs to uid {info.st_uid}, not to "
                              f"this user; set {CACHE_ENV} to a folder of your own")
    if info.st_mode & 0o077:
        folder.chmod(0o700)  # ours: close it (an old cache made with the umask's mode)
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(target: Path) -> bool:
    """Whether ``target`` is the very build recorded beside it (``<name>.sha256``, written
    after the compile): a truncated, corrupted or swapped file is rebuilt, never loaded."""
    record = target.with_suffix(".sha256")
    try:
        return target.is_file() and record.read_text().strip() == _sha256(target)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _machine_key() -> str:
    """What a ``-march=native`` build depends on: the CPU's identity and features."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                cpu += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{cpu}"


def compiler() -> str | None:
    """The C compiler the kernels are built with (``$CC``, else ``cc``, else ``gcc``)."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=64)
def _library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile ``source`` (or reuse the cached build) and load it; None if that fails."""
    if disabled():
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: the stacked trainer uses PyTorch ops only")
        return None
    key = hashlib.sha256("\0".join(
        [source, cc, " ".join(_FLAGS + extra_flags), _machine_key(), sys.platform]
    ).encode()).hexdigest()
    try:
        folder = private_cache_dir()
        target = folder / f"fedfusion_{key[:24]}.so"
        if not _verified(target):
            if target.exists():
                log.warning("kernel %s does not match its recorded hash: rebuilding it", target)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                c_file = Path(tmp) / "kernel.c"
                c_file.write_text(source)
                built = Path(tmp) / "kernel.so"
                command = [cc, *_FLAGS, *extra_flags, "-o", str(built), str(c_file)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=120)
                if result.returncode != 0:
                    log.warning("compiling the stacked trainer's kernels failed (PyTorch ops "
                                "are used instead): %s", result.stderr.strip()[-2000:])
                    return None
                record = Path(tmp) / "kernel.sha256"
                record.write_text(_sha256(built))
                # atomic renames: processes compiling at once all succeed; the record last,
                # so a reader never sees a record without its build
                os.replace(built, target)
                os.replace(record, target.with_suffix(".sha256"))
            if not _verified(target):
                log.warning("kernel %s changed while it was written: not loaded", target)
                return None
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the stacked trainer's kernels are unavailable (PyTorch ops are used "
                    "instead): %s", exc)
        return None


def _pointer(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _check(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape \
            or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous float32 CPU tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})")


@dataclass(frozen=True)
class ConvKernels:
    """Compiled direct convolution (stride 1, no padding, no dilation) of fixed sizes."""

    c: int
    o: int
    h: int
    w: int
    kh: int
    kw: int
    lib: ctypes.CDLL

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.h - self.kh + 1, self.w - self.kw + 1

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor:
        """``out[m, b] = conv2d(x[m, b], weight[m]) + bias[m]`` for ``x`` ``[M, B, C, H, W]``."""
        m, b = x.shape[:2]
        _check(x, (m, b, self.c, self.h, self.w), "input")
        _check(weight, (m, self.o, self.c, self.kh, self.kw), "weight")
        if bias is not None:
            _check(bias, (m, self.o), "bias")
        _check(out, (m, b, self.o, *self.out_hw), "output")
        self.lib.conv_fwd(_pointer(x), _pointer(weight), _pointer(bias), _pointer(out),
                          ctypes.c_long(m), ctypes.c_long(b))
        return out

    def weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor, grad_weight: torch.Tensor
                    ) -> torch.Tensor:
        m, b = x.shape[:2]
        _check(x, (m, b, self.c, self.h, self.w), "input")
        _check(grad_out, (m, b, self.o, *self.out_hw), "output gradient")
        _check(grad_weight, (m, self.o, self.c, self.kh, self.kw), "weight gradient")
        self.lib.conv_wgrad(_pointer(x), _pointer(grad_out), _pointer(grad_weight),
                            ctypes.c_long(m), ctypes.c_long(b))
        return grad_weight

    @functools.cached_property
    def has_input_grad(self) -> bool:
        """Whether :meth:`input_grad` is the fast one here (:func:`input_grad_block`)."""
        return input_grad_block(self.c, self.kw, self.out_hw[1]) > 0

    def input_grad(self, grad_out: torch.Tensor, weight: torch.Tensor, grad_in: torch.Tensor
                   ) -> torch.Tensor:
        """``grad_in[m, b]``: the gradient of the convolution's input, overwritten."""
        m, b = grad_out.shape[:2]
        _check(grad_out, (m, b, self.o, *self.out_hw), "output gradient")
        _check(weight, (m, self.o, self.c, self.kh, self.kw), "weight")
        _check(grad_in, (m, b, self.c, self.h, self.w), "input gradient")
        self.lib.conv_igrad(_pointer(grad_out), _pointer(weight), _pointer(grad_in),
                            ctypes.c_long(m), ctypes.c_long(b))
        return grad_in

def conv_kernels(c: int, o: int, h: int, w: int, kh: int, kw: int) -> ConvKernels | None:
    """Compiled kernels of a ``c -> o`` convolution with a ``kh x kw`` kernel on ``h x w``
    maps (stride 1, no padding), or None when unavailable."""
    if h < kh or w < kw:
        return None
    lib = _library(_conv_source(c, o, h, w, kh, kw))
    if lib is None:
        return None
    for name in ("conv_fwd", "conv_wgrad", "conv_igrad"):
        getattr(lib, name).restype = None
    return ConvKernels(c, o, h, w, kh, kw, lib)


@dataclass(frozen=True)
class PoolKernels:
    """Compiled 2x2 max-pool (stride 2), optionally fused with a ReLU."""

    lib: ctypes.CDLL

    def forward(self, a: torch.Tensor, out: torch.Tensor, arg: torch.Tensor, relu: bool
                ) -> torch.Tensor:
        """``a``: ``[..., H, W]`` contiguous; ``out``: ``[..., H//2, W//2]``; ``arg``: int32 of
        ``out``'s shape, the choice per window for :meth:`backward`."""
        h, w = a.shape[-2:]
        pooled = (*a.shape[:-2], h // 2, w // 2)
        _check(a, tuple(a.shape), "pool input")
        _check(out, pooled, "pool output")
        if arg.dtype != torch.int32 or not arg.is_contiguous() or tuple(arg.shape) != pooled:
            raise ValueError(f"pool choices: expected contiguous int32 of shape {pooled}")
        planes = a.numel() // (h * w) if h * w else 0
        self.lib.pool2_fwd(_pointer(a), _pointer(out), _pointer(arg), ctypes.c_long(planes),
                           ctypes.c_long(h), ctypes.c_long(w), ctypes.c_int(int(relu)))
        return out

    def backward(self, grad_out: torch.Tensor, arg: torch.Tensor, grad_in: torch.Tensor
                 ) -> torch.Tensor:
        h, w = grad_in.shape[-2:]
        pooled = (*grad_in.shape[:-2], h // 2, w // 2)
        _check(grad_out, pooled, "pool output gradient")
        _check(grad_in, tuple(grad_in.shape), "pool input gradient")
        if arg.dtype != torch.int32 or not arg.is_contiguous() or tuple(arg.shape) != pooled:
            raise ValueError(f"pool choices: expected contiguous int32 of shape {pooled}")
        planes = grad_in.numel() // (h * w) if h * w else 0
        self.lib.pool2_bwd(_pointer(grad_out), _pointer(arg), _pointer(grad_in),
                           ctypes.c_long(planes), ctypes.c_long(h), ctypes.c_long(w))
        return grad_in


def pool_kernels() -> PoolKernels | None:
    """The compiled 2x2 max-pool, or None when unavailable."""
    lib = _library(_POOL_SOURCE)
    if lib is None:
        return None
    lib.pool2_fwd.restype = None
    lib.pool2_bwd.restype = None
    return PoolKernels(lib)


_SGD_SOURCE = r"""
#include <math.h>
/* torch.optim.SGD's momentum step (no dampening, weight decay or Nesterov) in one pass:
   buf = buf * momentum; buf = buf + grad (two roundings, as PyTorch's mul_ then add_; built
   with -ffp-contract=off so the compiler does not fuse them); param = fma(-lr, buf, param)
   (one rounding, as PyTorch's add_(buf, alpha=-lr), checked by sgd_kernel). */
void sgd_momentum(float *restrict param, float *restrict buf, const float *restrict grad,
                  long n, float neg_lr, float momentum) {
    for (long i = 0; i < n; ++i) {
        float b = buf[i] * momentum;
        b = b + grad[i];
        buf[i] = b;
        param[i] = fmaf(neg_lr, b, param[i]);
    }
}
"""


@dataclass(frozen=True)
class SgdKernel:
    """SGD with momentum in one pass over each tensor, bit for bit PyTorch's three passes
    (``mul_``, ``add_``, ``add_`` with ``alpha``): 0.16 -> 0.10 ms a step for 5 stacked MLPs."""

    lib: ctypes.CDLL

    def bind(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             buffers: list[torch.Tensor]) -> Callable[[float, float], None]:
        """``step(lr, momentum)`` on these tensors, checked once here (they must keep their
        memory: the stacked trainer updates them in place)."""
        calls = []
        for p, g, b in zip(params, grads, buffers, strict=True):
            shape = tuple(p.shape)
            _check(p, shape, "parameter")
            _check(g, shape, "gradient")
            _check(b, shape, "momentum buffer")
            calls.append((_pointer(p), _pointer(b), _pointer(g), ctypes.c_long(p.numel())))
        return _BoundSgdStep(self.lib.sgd_momentum, calls, (params, grads, buffers))


@dataclass(frozen=True)
class _BoundSgdStep:
    function: Callable[..., None]
    calls: list[tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]]
    #: the tensors behind the pointers, kept alive as long as the step
    tensors: tuple[list[torch.Tensor], ...]

    def __call__(self, lr: float, momentum: float) -> None:
        neg_lr, mom = ctypes.c_float(-lr), ctypes.c_float(momentum)
        for p, b, g, n in self.calls:
            self.function(p, b, g, n, neg_lr, mom)


def torch_sgd(params: list[torch.Tensor], grads: list[torch.Tensor],
              buffers: list[torch.Tensor], lr: float, momentum: float) -> None:
    """``torch.optim.SGD``'s momentum step in PyTorch's ops: what :class:`SgdKernel` matches."""
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_add_(buffers, grads)
    torch._foreach_add_(params, buffers, alpha=-lr)


@functools.lru_cache(maxsize=1)
def _checked_sgd_kernel() -> SgdKernel | None:
    lib = _library(_SGD_SOURCE, ("-ffp-contract=off",))
    if lib is None:
        return None
    lib.sgd_momentum.restype = None
    kernel = SgdKernel(lib)
    # PyTorch's add_ with alpha rounds once (an FMA) where its CPU kernels are built with FMA:
    # use the kernel only where it reproduces PyTorch's arithmetic here, bit for bit
    generator = torch.Generator().manual_seed(0)
    sizes = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1001]
    probe = [[torch.randn(n, generator=generator) for n in sizes] for _ in range(3)]
    ours = [[t.clone() for t in part] for part in probe]
    theirs = [[t.clone() for t in part] for part in probe]
    step = kernel.bind(ours[0], ours[1], ours[2])
    for lr, momentum in ((0.01, 0.9), (0.1, 0.5), (0.0123, 0.99)):
        step(lr, momentum)
        torch_sgd(theirs[0], theirs[1], theirs[2], lr, momentum)
    if not all(torch.equal(a, b) for part, other in zip(ours, theirs, strict=True)
               for a, b in zip(part, other, strict=True)):
        log.info("the compiled SGD step differs from PyTorch's here: PyTorch's is used")
        return None
    return kernel


def sgd_kernel() -> SgdKernel | None:
    """The one-pass SGD step, or None when unavailable or not bit for bit PyTorch's here."""
    return None if disabled() else _checked_sgd_kernel()
