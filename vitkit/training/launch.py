"""`vitkit train --nproc N`: torchrun started for the ranks, tied to vitkit's process, and waited for.

Who hears a stop. The ranks run in sessions of their own (torchrun starts each so), so they hear only torchrun.
torchrun runs in a session of its own too (here), so it hears only vitkit: every stop signal reaches it exactly once,
passed on by `run_ranks`, whether it was sent to vitkit's process alone (a job runner, a container stopping, `kill`)
or to vitkit's process group (a terminal's Ctrl-C or Ctrl-\\, `kill -- -PGID`). Were torchrun in vitkit's group, a
group's signal would reach it twice, and one sent to vitkit alone never. If vitkit itself dies (SIGKILL, a crash),
Linux sends torchrun SIGTERM (`PR_SET_PDEATHSIG`), which stops and saves the ranks as a SIGTERM to vitkit does.

How long they have. torchrun gives the ranks its shutdown timeout (30 s unless `PET_SHUTDOWN_TIMEOUT` or
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` sets it; job runners commonly give 30 s too) to finish the step in hand (an
evaluation that falls on it included) and save it, then kills them; the checkpoints already on disk stay whole
either way. A second Ctrl-C does not wait: torchrun and the ranks are killed at once, as a single process is.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# the exit code of a run a signal stopped (the ranks' own, vitkit/training/trainer.py; SIGQUIT's is the shell's)
STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143,
             **({signal.SIGHUP: 129, signal.SIGQUIT: 131} if hasattr(signal, "SIGQUIT") else {})}

# run by `python -c` as torchrun's process, with vitkit's pid and torchrun's arguments: on Linux, SIGTERM when vitkit
# dies; then torchrun itself, as `python -m torch.distributed.run` would run it (cwd first on sys.path, as -m puts it)
TIED_TORCHRUN = """\
import os, runpy, signal, sys
if sys.platform.startswith("linux"):
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (ImportError, OSError, AttributeError) as e:
        sys.stderr.write(f"vitkit: torchrun is not tied to vitkit's process ({e}): if vitkit is killed, stop it yourself\\n")
if os.getppid() != int(sys.argv[1]):  # vitkit ended before the tie was made: start nothing
    sys.exit(143)
sys.argv = ["torch.distributed.run", *sys.argv[2:]]
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The command that runs `vitkit train ARGS` as `nproc` ranks on this machine (torchrun --standalone)."""
    return [sys.executable, "-c", TIED_TORCHRUN, str(os.getpid()), "--standalone", "--nproc-per-node", str(nproc),
            "-m", "vitkit", "train", *args]


# where torchrun reads the signals it handles: its --signals-to-handle option's variable (torch >= 2.9 sets the
# second from it, over any value there), and the variable its workers' context reads (older torch)
SIGNAL_VARS = ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE")


def torchrun_env() -> dict[str, str]:
    """This process's environment, with torchrun's own handling covering every signal `run_ranks` passes on, beside
    any the user named (a cluster's SIGUSR1, say) in either of torchrun's variables."""
    named = [n.strip() for var in SIGNAL_VARS for n in os.environ.get(var, "").split(",") if n.strip()]
    wanted = list(dict.fromkeys(named + [s.name for s in STOP_EXIT]))
    return {**os.environ, **{var: ",".join(wanted) for var in SIGNAL_VARS}}


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none found elsewhere)."""
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid).encode():
            found.append(int(name))
    return found


def _kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its ranks, which run in sessions of their own where torchrun's death does not reach them.
    torchrun is stopped first, so it neither starts nor reaps a rank meanwhile: the pids found stay its children."""
    try:
        proc.send_signal(signal.SIGSTOP)
    except (OSError, AttributeError, ValueError):  # no SIGSTOP here, or gone
        pass
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.kill()
    proc.wait()


def run_ranks(cmd: list[str]) -> int:
    """Start `cmd` (torchrun) in its own session and wait for it, passing each stop on once (the module's docstring).

    The first Ctrl-C, SIGTERM or SIGHUP is passed on to torchrun, which passes it to every rank: they stop at the
    same step and save it, and this waits for them (exit 130, 143 or 129, the first signal's; 0 if the run ended
    whole all the same). A Ctrl-C after any of them stops waiting (KeyboardInterrupt): torchrun and the ranks are
    killed at once, the steps since the last checkpoint lost; further SIGTERMs and SIGHUPs change nothing. Ctrl-\\
    (SIGQUIT) is passed on as it is: torchrun ends the ranks at once, as Ctrl-\\ ends any program (exit 131). A
    signal while torchrun is being started is passed on once it has started; one before that stops at once. The
    handlers are this function's own, as the ranks' are theirs (a process started with Ctrl-C ignored, as by some
    job runners and test workers, still hears it); a SIGHUP ignored from the start (`nohup`) stays ignored. Off the
    main thread (`vitkit.cli.main` called in a thread) no handler can be installed: Python's own handling, and
    torchrun stays in this process group, where a terminal's signals reach it directly."""
    asked, proc, starting, pending = None, None, False, []

    def on_stop(signum, frame) -> None:
        nonlocal asked
        if proc is None:
            if starting:  # torchrun may exist already: pass it on once Popen returns
                pending.append(signum)
                return
            if signum == signal.SIGINT:  # before torchrun started (it would never hear it): stop at once
                raise KeyboardInterrupt
            raise SystemExit(STOP_EXIT[signum])
        if asked is not None:
            if signum == signal.SIGINT:  # a Ctrl-C after a first stop: abort at once
                raise KeyboardInterrupt
            return  # the ranks are stopping already
        asked = signal.Signals(signum)
        proc.send_signal(signum)
        if signum == getattr(signal, "SIGQUIT", None):  # not on Windows
            note = b"vitkit: SIGQUIT: torchrun ends the ranks at once (the steps since the last checkpoint are lost)\n"
        else:
            what = b"Ctrl-C" if signum == signal.SIGINT else asked.name.encode()
            note = b"vitkit: " + what + b": waiting for the ranks to save the step in hand (Ctrl-C again aborts at once)\n"
        os.write(2, note)

    installed = {}
    try:
        for sig in STOP_EXIT:  # before torchrun starts: it gets the default handling, not an inherited SIG_IGN
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup's: hangups are not a stop
            try:
                installed[sig] = signal.signal(sig, on_stop)
            except ValueError:  # not the main thread
                break
        env = torchrun_env()
        starting = True
        child = subprocess.Popen(cmd, env=env, start_new_session=bool(installed))
        proc, starting = child, False
        try:
            for signum in pending[:1]:  # a signal that came while it started
                on_stop(signum, None)
            code = proc.wait()  # a handler returns on a first signal, and the wait goes on
        except KeyboardInterrupt:
            if installed or asked is not None:
                _kill_now(proc)
                raise
            asked = signal.SIGINT  # Python's own handling (off the main thread): the first Ctrl-C, wait for the ranks
            code = proc.wait()
    finally:
        starting = False
        for sig, old in installed.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
    return STOP_EXIT[asked] if asked is not None and code != 0 else code
