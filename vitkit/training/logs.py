"""What a run reports: a one-line progress bar, metrics.jsonl and TensorBoard. Only rank 0 writes anything."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..cache import atomic_write


class Progress:
    """One status line: loss, accuracy, images/s, ETA; plain lines when not on a terminal."""

    def __init__(self, total: int, enabled: bool = True, main: bool = True) -> None:
        """enabled: the status line; main: this process writes at all (rank 0). Messages print whenever `main`."""
        self.total, self.enabled, self.main, self.tty = total, enabled and main, main, sys.stderr.isatty()

    def update(self, step: int, epoch: int, loss: float, acc: float, ips: float, eta_s: float, lr: float) -> None:
        if not self.enabled:
            return
        frac = step / self.total
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        eta = time.strftime("%H:%M:%S", time.gmtime(max(0, eta_s)))
        line = f"[{bar}] {step}/{self.total} ep {epoch} loss {loss:.4f} acc {acc:.3f} {ips:.0f} img/s lr {lr:.2e} ETA {eta}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.main:
            return
        if self.enabled and self.tty:
            print(file=sys.stderr)
        print(text, file=sys.stderr, flush=True)


class MetricsLog:
    """metrics.jsonl and TensorBoard. A resumed run first drops what was logged after its checkpoint's step (the
    steps it is about to run again), and a record cut short by a kill, so every step is logged once.
    `enabled=False` (every rank but 0) writes nothing."""

    def __init__(self, out: Path, resumed_at: int | None = None, enabled: bool = True) -> None:
        self.file = self.tb = None
        if not enabled:
            return
        path = out / "metrics.jsonl"
        if resumed_at is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line being written when the run was killed
                if rec.get("step", 0) <= resumed_at:
                    kept.append(line)
            atomic_write(path, lambda p: p.write_text("".join(f"{x}\n" for x in kept)))
        self.file = open(path, "a")
        try:
            # start-up time: tensorboard's import is slow, and only rank 0's log needs it
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events at and after it, as metrics.jsonl above
            self.tb = SummaryWriter(str(out / "tb"), purge_step=None if resumed_at is None else resumed_at + 1)
        except Exception:  # noqa: BLE001 - tensorboard is optional
            self.tb = None

    def log(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{prefix}/{k}", v, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
