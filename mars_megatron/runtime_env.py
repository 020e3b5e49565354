"""The numerics environment of every process a run starts: which CPU code paths its math libraries take and
how many threads they use.

Why: the same run must give the same figures, bit for bit, on any x86-64 machine with AVX2, idle or
loaded, whatever its core count (docs/train.md, "What repeats"). Left alone, three things follow the host
(measured on the tiny run's `mars sft`, 40 steps, final weights compared byte for byte):

* ATen's vectorised kernels pick the widest ISA the CPU has (AVX-512 on one host, AVX2 on another), and
  the two give different sums: ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 host changed the weights.
* MKL (torch's fp32 GEMMs, and its elementwise ``exp`` through VML) blocks its loops by the cache sizes
  it detects and, without conditional numerical reproducibility (CNR), may schedule its threads
  dynamically; its code path follows the CPU's vendor and generation (on an AVX-512 Xeon, VML's default
  ``exp`` differs from COMPATIBLE's). On an AMD host MKL honours no branch but ``MKL_CBWR=COMPATIBLE``
  (``AVX2``, ``AVX512``, ``SSE4_2`` … all print ``CNR:AUTO`` under ``MKL_VERBOSE=1``, and
  ``MKL_ENABLE_INSTRUCTIONS`` changes nothing), so COMPATIBLE (SSE2 without the approximate ``rcpps`` /
  ``rsqrtps``, documented by Intel to give the same results on Intel and compatible processors) is the
  one branch that is the same everywhere. Measured cost: about +50% per `mars sft` step of the tiny model.
* Thread counts taken from the host (``os.cpu_count()``) change how reductions are split: 1 and 2 threads
  gave different weights. Every process of a run uses :func:`cpu_threads` threads (1 unless
  ``OMP_NUM_THREADS`` says otherwise), which was no slower on the tiny model than 2 threads on 2 cores.

:func:`apply` puts :data:`NUMERICS_ENV` into ``os.environ`` (each variable only where the user has not set
it: an explicit value always wins) before torch is imported: the ``mars`` command calls it first thing,
its spawned gloo ranks, its Ray cluster's workers (and reward workers) inherit it, and a Ray cluster the
run joins gets it through the job's ``runtime_env`` (:func:`ray_runtime_env`). The variables are read when
the libraries load, so a process that imported torch before :func:`apply` keeps its own paths.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping

X86_PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's kernels: AVX2 on every x86 host (the default picks AVX-512)
    "MKL_CBWR": "COMPATIBLE",  # MKL's one code path that is the same on every x86 vendor and generation
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (bf16 matmuls on CPU) no wider than AVX2
}
"""Code-path pins for x86-64; elsewhere (ARM) the libraries have no such choice to pin."""

THREAD_PINS: dict[str, str] = {
    "OMP_NUM_THREADS": "1",  # torch's intra-op threads (and MKL's): a constant, not the host's core count
    "OMP_DYNAMIC": "FALSE",  # OpenMP may not shrink a parallel region when the machine is busy
    "MKL_DYNAMIC": "FALSE",  # nor may MKL choose fewer threads than asked
}
"""Thread pins for every platform."""

DEFAULT_THREADS = int(THREAD_PINS["OMP_NUM_THREADS"])


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def numerics_defaults() -> dict[str, str]:
    """The variables :func:`apply` sets on this platform and the values it gives them by default."""
    return {**(X86_PINS if _is_x86() else {}), **THREAD_PINS}


NUMERICS_ENV = numerics_defaults()
"""This platform's defaults (see :func:`numerics_defaults`)."""


def apply(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every variable of :data:`NUMERICS_ENV` that ``environ`` (default ``os.environ``) lacks; returns
    the values in effect afterwards (the user's where set). Call it before torch is imported."""
    env = os.environ if environ is None else environ
    for key, value in NUMERICS_ENV.items():
        env.setdefault(key, value)
    cpu_threads(env)  # a bad OMP_NUM_THREADS fails here, naming it
    return {key: env[key] for key in NUMERICS_ENV}


def in_effect(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The values of :data:`NUMERICS_ENV`'s variables in ``environ``: the user's, else the defaults."""
    env = os.environ if environ is None else environ
    return {key: env.get(key, value) for key, value in NUMERICS_ENV.items()}


def cpu_threads(environ: MutableMapping[str, str] | None = None) -> int:
    """Intra-op CPU threads of each process of a run: ``OMP_NUM_THREADS`` where set, else
    :data:`DEFAULT_THREADS`. A constant, so 2 cores and 16 cores split their reductions alike."""
    env = os.environ if environ is None else environ
    raw = env.get("OMP_NUM_THREADS", str(DEFAULT_THREADS))
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a whole number >= 1, got {raw!r}")
    return threads


def ray_runtime_env() -> dict[str, dict[str, str]]:
    """A Ray ``runtime_env`` carrying the values in effect, for a cluster this process did not start (whose
    workers would not inherit this process's environment)."""
    return {"env_vars": in_effect()}
