"""Overlap cost model: Z = max(Y, X) per overlap window, computation slowed by communication.

Two forms share the window arithmetic:

* **GPU (Lagom's wave/bandwidth model**, arXiv 2602.20656 section 3, PAPERS.md section 2): a
  computation kernel i that overlaps communication j runs on the SMs the communication leaves,
  ``lambda - NC_j``, in ``g = ceil(mu_i / ((lambda - NC_j) * TB_i))`` waves, each wave taking
  ``f = theta_i + (lambda - NC_j) * TB_i * D_i / (B - V(NC_j, C_j))`` (memory-bound wave: the bytes
  the wave's blocks move over the bandwidth the communication leaves). The paper does not give
  ``V`` or ``x_j``; we use (our choice, documented in docs/overlap.md)
  ``V(NC, C) = NC * mem_bw_per_cta * min(1, C / chunk_saturation)`` and
  ``x_j = latency + bytes / min(link_bw, NC * link_bw_per_cta * min(1, C / chunk_saturation))``.
* **CPU (gloo)**: nothing is assumed; ``fit_cpu_ddp`` fits compute and exposed-communication time
  against the number of gradient buckets from measured trials (least squares) and reports R^2.

All times are microseconds, bandwidths bytes/us, sizes bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """``sms`` = lambda (streaming multiprocessors), ``mem_bw_bytes_per_us`` = B-bar."""

    sms: int
    mem_bw_bytes_per_us: float


@dataclass(frozen=True, kw_only=True)
class ComputeKernel:
    """``blocks`` = mu_i, ``blocks_per_sm`` = TB_i, ``bytes_per_block`` = D_i, ``theta_us`` = theta_i."""

    blocks: int
    blocks_per_sm: int
    bytes_per_block: float
    theta_us: float


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    """One communication: payload, fixed latency, link bandwidth and per-CTA rates."""

    bytes: float
    latency_us: float
    link_bw_bytes_per_us: float
    link_bw_per_cta: float
    mem_bw_per_cta: float
    chunk_saturation_bytes: float


@dataclass(frozen=True, kw_only=True)
class CommSetting:
    """Lagom's ``s_j``: ``nc`` CTAs (channels) and chunk size ``chunk_bytes`` (C)."""

    nc: int
    chunk_bytes: float


def mem_bw_taken(comm: CommSpec, s: CommSetting) -> float:
    """V(NC, C): memory bandwidth the communication takes from overlapped computation."""
    return s.nc * comm.mem_bw_per_cta * min(1.0, s.chunk_bytes / comm.chunk_saturation_bytes)


def comm_time_us(comm: CommSpec, s: CommSetting) -> float:
    """x_j(s_j): more CTAs / bigger chunks are faster until the link saturates."""
    bw = min(comm.link_bw_bytes_per_us, s.nc * comm.link_bw_per_cta * min(1.0, s.chunk_bytes / comm.chunk_saturation_bytes))
    return comm.latency_us + comm.bytes / bw


def waves(kernel: ComputeKernel, free_sms: int) -> int:
    """g_ij = ceil(mu_i / ((lambda - NC_j) * TB_i))."""
    assert free_sms > 0, "communication takes every SM"
    return math.ceil(kernel.blocks / (free_sms * kernel.blocks_per_sm))


def wave_time_us(kernel: ComputeKernel, gpu: GpuSpec, free_sms: int, taken_bw: float) -> float:
    """f_ij = theta_i + (lambda - NC_j) * TB_i * D_i / (B - V)."""
    left = gpu.mem_bw_bytes_per_us - taken_bw
    assert left > 0, "communication takes all memory bandwidth"
    return kernel.theta_us + free_sms * kernel.blocks_per_sm * kernel.bytes_per_block / left


def kernel_time_us(kernel: ComputeKernel, gpu: GpuSpec, comm: CommSpec | None = None,
                   s: CommSetting | None = None) -> float:
    """y_i = g_ij * f_ij: kernel time while communication ``comm`` at ``s`` runs beside it."""
    nc, taken = (0, 0.0) if comm is None else (s.nc, mem_bw_taken(comm, s))
    free = gpu.sms - nc
    return waves(kernel, free) * wave_time_us(kernel, gpu, free, taken)


@dataclass(frozen=True, kw_only=True)
class Window:
    """An overlap window: computation kernels and the communication (index) that overlaps them."""

    kernels: tuple[ComputeKernel, ...]
    comm: int | None


def window_times_us(window: Window, gpu: GpuSpec, comms: Sequence[CommSpec],
                    settings: Sequence[CommSetting]) -> tuple[float, float, float]:
    """(Y, X, Z) of one window: Z = max(Y, X)."""
    j = window.comm
    comm, s = (None, None) if j is None else (comms[j], settings[j])
    y = sum(kernel_time_us(k, gpu, comm, s) for k in window.kernels)
    x = 0.0 if j is None else comm_time_us(comm, s)
    return y, x, max(y, x)


def step_times_us(windows: Sequence[Window], gpu: GpuSpec, comms: Sequence[CommSpec],
                  settings: Sequence[CommSetting]) -> tuple[float, tuple[float, ...], float]:
    """(Y, x per communication, Z) of a step made of consecutive windows; Z sums the windows' max."""
    y_total, z_total, x = 0.0, 0.0, [0.0] * len(comms)
    for w in windows:
        y, xw, z = window_times_us(w, gpu, comms, settings)
        y_total, z_total = y_total + y, z_total + z
        if w.comm is not None:
            x[w.comm] += xw
    return y_total, tuple(x), z_total


def h_metric(y_before_us: float, y_after_us: float, x_before_us: float, x_after_us: float) -> float:
    """Lagom's priority H = (Y' - Y) / (x - x'): computation added per unit of communication saved."""
    saved = x_before_us - x_after_us
    if saved <= 0:
        return math.inf
    return (y_after_us - y_before_us) / saved


# --------------------------------------------------------------------------- CPU (fitted)

@dataclass(frozen=True)
class LinearFit:
    """``target ~ coef . features(n)``, fitted by least squares, with its R^2 on the data."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float

    def predict(self, row: Sequence[float]) -> float:
        return float(np.dot(self.coef, row))


def fit_linear(rows: Sequence[Sequence[float]], targets: Sequence[float], names: Sequence[str]) -> LinearFit:
    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    if a.shape[0] < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} measurements to fit {list(names)}, got {a.shape[0]}")
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    resid = b - a @ coef
    total = float(((b - b.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    return LinearFit(tuple(names), tuple(float(c) for c in coef), r2)


@dataclass(frozen=True)
class CpuDdpFit:
    """Measured CPU model of overlapped DDP gradient reduce against the bucket count n.

    ``compute``: Y(n) = y0 + a * n (each concurrent gloo all-reduce steals CPU from backward);
    ``exposed``: E(n) = e0 + t / n + c * n (the last bucket's tail shrinks as 1/n; every bucket
    costs a fixed overhead). Z(n) is predicted as Y + E + the non-overlapped rest.
    """

    compute: LinearFit
    exposed: LinearFit
    rest_us: float

    def predict_z_us(self, n_buckets: int) -> float:
        n = float(n_buckets)
        return self.compute.predict([1.0, n]) + self.exposed.predict([1.0, 1.0 / n, n]) + self.rest_us


def fit_cpu_ddp(n_buckets: Sequence[int], y_us: Sequence[float], exposed_us: Sequence[float],
                z_us: Sequence[float]) -> CpuDdpFit:
    """Fit ``CpuDdpFit`` from overlapped-DDP measurements (one entry per configuration)."""
    compute = fit_linear([[1.0, n] for n in n_buckets], y_us, ("y0_us", "per_bucket_us"))
    exposed = fit_linear([[1.0, 1.0 / n, n] for n in n_buckets], exposed_us,
                         ("e0_us", "tail_us", "per_bucket_us"))
    rest = float(np.median([z - y - e for z, y, e in zip(z_us, y_us, exposed_us)]))
    return CpuDdpFit(compute, exposed, rest)
