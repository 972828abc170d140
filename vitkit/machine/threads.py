"""How many threads torch runs on a CPU that other work shares: the thread policy of eager inference, the compiled
engine, `predict`, `serve` and training.

torch's CPU kernels (ATen, oneDNN, MKL, and the loops a compiled package runs) share one OpenMP runtime, libgomp,
which splits every parallel loop into one fixed share per thread and waits at its end for the last share. On a
quiet machine that costs nothing. When another process is runnable, the scheduler puts one of torch's threads
aside for a time slice, and every loop waits for it while its siblings spin on their cores (libgomp's default is
300,000 spins before it sleeps, about 15-20 ms on an Intel Xeon): eager ViT-S/16 at batch 1 on 2 cores fell from
11 to 2.4 img/s beside one busy process, a compiled package from 12 to ~470 ms an image (issue 54). ONNX Runtime
and OpenVINO hand out a loop's work in small pieces to whichever thread is free (their own pools, TBB), so a thread
set aside delays nothing.

The policy (`Governor`, every command and any loop that calls it): before each batch or step, at most every
INTERVAL_S, it reads how much CPU other processes used on the cores this process may run on (/proc/stat, minus this
process's own time; the hypervisor's steal counts as theirs) and sets torch's thread count to the cores they leave
(`threads_for`: a core counts as taken once they use more than BUSY_CORE of it), never more than torch had, never
fewer than one. A quiet machine keeps every thread. It never acts where the count is the user's: a thread count
given (`--threads`, `run.threads`), OMP_NUM_THREADS set, or torch.set_num_threads called while it runs; and it never
raises the count above the one it found (a program that set fewer threads keeps them).

How long idle threads spin is left to libgomp (or the user's OMP_WAIT_POLICY, GOMP_SPINCOUNT). A shorter spin
(GOMP_SPINCOUNT=3000, ~0.1 ms) was the command's default for a time; measured side by side it kept no larger share
beside busy processes (the governor runs one thread there, which waits for no sibling) and cost eager 14-27% on a
quiet machine (benchmarks/NOTES.md section 40).

A measurement that a choice is cached from (`--backend auto`'s engines, the GEMM paths) is watched the same way
(`LoadWatch`): where other processes used more than BUSY_LIMIT cores while it was timed, the choice holds for this
run only and is not cached, and a line says so.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

# torch is imported by the functions that use it: importing this module leaves torch unloaded

log = logging.getLogger(__name__)

BUSY_CORE = 0.25  # other processes using more than this of a core (on average over a window) take that core
BUSY_LIMIT = 0.25  # cores other processes may use while a cached choice is measured (tests set math.inf)
INTERVAL_S = 0.5  # the governor reads the counters at most this often
MIN_WINDOW_S = 0.1  # its first decision waits until the counters span this long (10 ms ticks: 20 on 2 cores)
ADAPT = True  # False: no governor changes torch's thread count (tests; A/Bs)
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---- what other processes use ----------------------------------------------------------------------------------

def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; every CPU where the platform has none)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def busy_seconds(stat: str, cpus: set[int], hz: int = _HZ) -> float:
    """CPU-seconds the `cpus` were busy since boot, from the text of /proc/stat: user, nice, system, irq, softirq and
    steal (the hypervisor running another machine), not idle or iowait."""
    ticks = 0
    for line in stat.splitlines():
        if not line.startswith("cpu"):
            break  # the per-CPU lines come first
        name, *fields = line.split()
        if name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = ([int(f) for f in fields[:8]] + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
    return ticks / hz


@dataclass(frozen=True)
class Reading:
    """The counters at one moment: `wall` (monotonic seconds), `busy` (CPU-seconds the allowed CPUs were busy, all
    processes), `own` (CPU-seconds this process used, its ended children included)."""

    wall: float
    busy: float
    own: float


def read(cpus: set[int] | None = None) -> Reading | None:
    """The counters now, or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            busy = busy_seconds(f.read(), allowed_cpus() if cpus is None else cpus)
    except (OSError, ValueError, ArithmeticError):  # ArithmeticError: a counter too large for a float (OverflowError)
        return None
    t = os.times()
    return Reading(time.monotonic(), busy, time.process_time() + t.children_user + t.children_system)


def others_between(a: Reading, b: Reading) -> float:
    """Cores' worth of CPU that other processes used between two readings (0 for an empty window)."""
    wall = b.wall - a.wall
    if wall <= 0:
        return 0.0
    return max(0.0, (b.busy - a.busy) - (b.own - a.own)) / wall


def threads_for(others: float, allowed: int, most: int) -> int:
    """The threads to run beside other processes that use `others` cores of the `allowed`: the cores they leave (a
    core counts as taken once they use more than BUSY_CORE of it), at most `most`, at least one."""
    taken = max(0, math.ceil(others - BUSY_CORE)) if math.isfinite(others) else allowed
    return max(1, min(most, allowed - taken))


# ---- the governor -----------------------------------------------------------------------------------------------

_SET: int | None = None  # the count a governor set last: not the user's
_BEFORE: int | None = None  # torch's count before any governor changed it


def ceiling() -> int:
    """The thread count torch had before any governor lowered it (the engines that keep their own pools, ONNX
    Runtime's and OpenVINO's, are opened with it)."""
    import torch

    return _BEFORE or torch.get_num_threads()


def user_threads(threads: int | None = None, environ: dict[str, str] | None = None) -> str:
    """Why the thread count is the user's ("" where it is not): `threads` given, OMP_NUM_THREADS set, or ADAPT off.
    (A count set with torch.set_num_threads below torch's default needs none of these: a governor never raises the
    count above the one it finds.)"""
    environ = os.environ if environ is None else environ
    if threads:
        return f"{threads} threads asked for"
    if environ.get("OMP_NUM_THREADS"):
        return f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}"
    if not ADAPT:
        return "vitkit.machine.threads.ADAPT is off"
    return ""


class Governor:
    """torch's thread count for the work of one thread (a command's batches, a server's worker, a training loop):
    `step()` before each batch sets it to the cores other processes leave (`threads_for`), reading the counters at
    most every `interval_s`; `threads` (or any count the user set, `user_threads`) fixes it instead. `close()`
    puts back the count it found. Call `step` in the thread that runs the model (libgomp keeps one count for the
    process, other OpenMP runtimes one per thread)."""

    def __init__(self, threads: int | None = None, interval_s: float = INTERVAL_S) -> None:
        import torch

        self.found = torch.get_num_threads()
        self.fixed = user_threads(threads)
        if threads:
            torch.set_num_threads(threads)
        self.current = torch.get_num_threads()
        # a count another governor lowered is not a ceiling: the count before it is
        self.most = _BEFORE if not self.fixed and _BEFORE and self.current == _SET else self.current
        self.allowed = len(allowed_cpus())
        self.interval = interval_s
        self.last = None if self.fixed else read()
        self.first = True
        self.others = 0.0
        if self.last is None and not self.fixed:
            self.fixed = "no /proc/stat to read the load from"

    def step(self) -> int:
        """The thread count for the next batch, set in this thread; changed only from the counters' window since
        the last decision (the first waits until it spans MIN_WINDOW_S)."""
        global _SET, _BEFORE
        import torch

        if self.fixed:
            return torch.get_num_threads()
        if torch.get_num_threads() != self.current:  # someone else set it since: theirs from now on
            self.fixed = f"torch.set_num_threads({torch.get_num_threads()}) was called"
            self.current = torch.get_num_threads()
            return self.current
        if self.last is None:
            return self.current
        if not self.first and time.monotonic() - self.last.wall < self.interval:
            return self.current  # between decisions: no /proc/stat read on the batch's path
        now = read()
        if now is None:
            return self.current
        span = now.wall - self.last.wall
        if self.first and span < MIN_WINDOW_S:
            time.sleep(MIN_WINDOW_S - span)
            now = read() or now
        elif not self.first and span < self.interval:
            return self.current
        self.others = others_between(self.last, now)
        self.last, self.first = now, False
        want = threads_for(self.others, self.allowed, self.most)
        if want != self.current:
            if _BEFORE is None:
                _BEFORE = self.found
            torch.set_num_threads(want)
            self.current = _SET = want
            log.debug("other processes use %.2f of %d cores: %d threads", self.others, self.allowed, want)
        return self.current

    def restart(self) -> None:
        """Start a new window now (the next decision waits until it spans MIN_WINDOW_S): for a caller that knows the
        time since the last step says nothing of the load to come (a benchmark that paused this process)."""
        if not self.fixed:
            self.last, self.first = read() or self.last, True

    def close(self) -> None:
        """Put back the thread count this governor found (unless it was never its to change)."""
        import torch

        if not self.fixed and torch.get_num_threads() == self.current != self.found:
            torch.set_num_threads(self.found)


def settle(threads: int | None = None) -> int:
    """The thread count the load allows now, set in this thread (one `Governor` decision over MIN_WINDOW_S; the
    count as it is where it is the user's): what a measurement that is about to run should run with."""
    return Governor(threads).step()


# ---- measurements that a cached choice comes from ---------------------------------------------------------------

class LoadWatch:
    """Other processes' CPU use over the timed stretches of a measurement (`with watch.window(): ...`): `others`
    is the most cores they used in any stretch, `busy` whether that passes BUSY_LIMIT (the choice measured then is
    for this run only: `note`)."""

    def __init__(self) -> None:
        self.others = 0.0
        self.allowed = len(allowed_cpus())

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        a = read()
        try:
            yield
        finally:
            b = read()
            if a is not None and b is not None:
                self.others = max(self.others, others_between(a, b))

    @property
    def busy(self) -> bool:
        return self.others > BUSY_LIMIT

    def note(self, what: str) -> str:
        """One line: `what` was measured while other processes used the CPU, so it holds for this run only."""
        return (f"{what}: measured while other processes used {self.others:.1f} of {self.allowed} cores, so chosen "
                f"for this run only, not cached")

