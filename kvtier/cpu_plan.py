"""How compute uses a CPU box: replicas, torch threads per replica, and the allocator preload.

One pure function (`plan_cpu`) decides the layout from the usable CPUs and what the user pinned;
`kvtier up` and each compute replica print what it chose. The allocator part follows vLLM's CPU
docs where it measured a gain: tcmalloc (Debian's libtcmalloc-minimal4) is preloaded into compute
processes when installed; Intel OpenMP (libiomp5, a wheel in the venv with vLLM or
`intel-openmp`) only on request (KVTIER_PRELOAD_ALLOCATOR=iomp; `allocator_libs`). Both can only
be preloaded (LD_PRELOAD at exec), so the launcher sets them (`preload_env`), and a replica
reports what it actually runs with (`loaded_allocators`). Threads of ours are named in the OS
too (`name_os_thread`), so `top -H` tells them apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Searched in this order; the first match of each library is preloaded.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_NAMES = ("libiomp5.so",)
LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
# unset or 1: tcmalloc; iomp: tcmalloc and Intel OpenMP; 0: neither (the system allocator).
PRELOAD_ENV = "KVTIER_PRELOAD_ALLOCATOR"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def allocator_libs(iomp: bool | None = None) -> list[str]:
    """Paths of the libraries to preload that this machine has: tcmalloc, and Intel OpenMP when
    `iomp` (default: $KVTIER_PRELOAD_ALLOCATOR is `iomp`); none when that variable is 0.

    NOTE: a replica preloads tcmalloc alone by default. Intel OpenMP (vLLM's recommendation for
    its own engine) bought it nothing here and doubled its system time: a replica's forward is
    many small ops with Python between them, where Intel's threads go to sleep and wake (futex)
    between regions; on a shared machine that wake-up cost 2x wall time in some runs
    (bench/README.md, "Compute against vLLM's CPU engine")."""
    choice = os.environ.get(PRELOAD_ENV, "1")
    if choice == "0":
        return []
    wanted = [(TCMALLOC_NAMES, LIB_DIRS)]
    if iomp or (iomp is None and choice == "iomp"):
        wanted.append((IOMP_NAMES, (f"{sys.prefix}/lib", *LIB_DIRS)))
    found = []
    for names, dirs in wanted:
        path = next((Path(d) / n for n in names for d in dirs if (Path(d) / n).is_file()), None)
        if path is not None:
            found.append(str(path))
    return found


def preload_env(env: dict[str, str], libs: list[str]) -> dict[str, str]:
    """`env` with `libs` first in LD_PRELOAD (each once; what was there stays after them). With
    Intel OpenMP, its threads spin 5 ms after a parallel region, not 200 (KMP_BLOCKTIME, as vLLM
    sets it): a replica's threads would otherwise spin through the step's Python work between
    forwards, on the cores that work needs. A value already in `env` stays."""
    current = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    merged = [*libs, *(p for p in current if p not in libs)]
    if merged:
        env = {**env, "LD_PRELOAD": " ".join(merged)}
    if any(Path(p).name in IOMP_NAMES for p in libs):
        env = {"KMP_BLOCKTIME": "5", **env}
    return env


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible (its driver's /proc entry; torch is not imported)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def loaded_allocators() -> str:
    """What this process runs with: 'tcmalloc + Intel OpenMP', 'tcmalloc', ... or 'system malloc'
    (read from its own memory map; on a system without /proc, from LD_PRELOAD)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    names = [
        label for key, label in (("libtcmalloc", "tcmalloc"), ("libiomp5", "Intel OpenMP")) if key in maps
    ]
    return " + ".join(names) if names else "system malloc"


@dataclass(frozen=True)
class CpuPlan:
    """replicas: compute processes per node; threads: torch threads of each; cpus: usable CPUs;
    preload: libraries preloaded into each replica; why: one line saying how it was chosen."""

    replicas: int
    threads: int
    cpus: int
    preload: tuple[str, ...]
    why: str

    def describe(self) -> str:
        libs = ", ".join(Path(p).name for p in self.preload) or "none (system malloc, GNU OpenMP)"
        return f"{self.replicas} replica(s) x {self.threads} thread(s) on {self.cpus} CPUs ({self.why}); preload: {libs}"


SMALL_BOX = 2  # CPUs up to which the default is one replica of one thread per CPU (plan_cpu)


def plan_cpu(
    replicas: int | None = None, threads: int | None = None, cpus: int | None = None, device: str = "cpu"
) -> CpuPlan:
    """The layout of a node's compute: what the user pinned (None: not pinned), the rest chosen.

    NOTE: on a small box (SMALL_BOX CPUs or fewer) the default is a replica of one thread per
    CPU. Measured, 2 CPUs, the 27M Llama of bench/serve_vs_vllm.py against vLLM's CPU engine in
    the same runs (2026-12-04, three runs each way): 2 x 1 gave shared-prefix 0.90-0.96x, unique
    1.26-1.33x, decode 0.75-0.81x; 1 x 2 gave 0.70-0.79x, 1.05-1.09x, 0.67-0.71x. A team of 2
    OpenMP threads on 2 cores waits at every barrier for whichever thread the event loop, the
    cache service or a neighbour has descheduled (a decode step 20 ms quiet, 160-1700 ms at load
    4-13; one thread 27-60 ms); vLLM's CPU engine likewise runs its model on one thread and keeps
    the other core for its scheduler. (Before sampling moved to the forward thread, 1 x 2 had
    measured better: decode 466 tok/s against 231.) Rechecked after admission stopped computing a
    shared prompt twice (the stack alone, alternated, load 1.9-2.9): 2 x 1 decode 751-765 tok/s,
    1 x 2 630-658; shared-prefix 756-1086 against 603-618 (1 x 2 spends less CPU per token, but
    waits). A bigger box gets one replica on every CPU,
    whose batched forward splits its matmuls across the threads, without N copies of the weights
    (not measured here: this machine has 2 CPUs). device "cuda": the GPU runs the model; two
    replicas of one thread, as before.
    """
    cpus = cpus or usable_cpus()
    preload = tuple(allocator_libs())
    if device != "cpu":
        return CpuPlan(replicas or 2, threads or 1, cpus, preload, "a GPU runs the model")
    if replicas is None and threads is None:
        if cpus <= SMALL_BOX:
            return CpuPlan(cpus, 1, cpus, preload, "a replica of one thread per CPU on a small box")
        return CpuPlan(1, cpus, cpus, preload, "one replica on every CPU")
    if threads is None:
        return CpuPlan(replicas, max(1, cpus // replicas), cpus, preload, "the CPUs split between replicas")
    if replicas is None:
        return CpuPlan(max(1, cpus // threads), threads, cpus, preload, "as many replicas as the CPUs hold")
    return CpuPlan(replicas, threads, cpus, preload, "as given")


def plan_for_flags(args) -> CpuPlan:
    """`kvtier up`'s layout from its --replicas / --threads (None where left out), written back to
    `args` so every flag built from them agrees."""
    plan = plan_cpu(args.replicas, args.threads, device="cuda" if gpu_present() else "cpu")
    args.replicas, args.threads = plan.replicas, plan.threads
    return plan


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) in the OS too, as ``top -H`` and
    /proc/<pid>/task/<tid>/comm show it: Python names its threads for Python only, so every
    thread (of vLLM's engine process, of the cache service) shows its process's name otherwise.
    Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
