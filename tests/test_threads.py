"""The thread policy on a shared CPU (`vitkit.machine.threads`, issue 54): the load read from /proc/stat, the thread
count it allows, the governor that applies it (and leaves a user's count alone), the command's OpenMP spin preset,
and choices measured under load (--backend auto's engines, the GEMM paths) kept out of the cache. The load is
scripted (`Readings`), never the machine's own; nothing here is timed."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.machine import engine, gemm
from vitkit.machine import threads as tp

REPO = Path(__file__).resolve().parents[1]

STAT = """cpu  900 0 100 5000 10 0 0 50 0 0
cpu0 100 0 50 2500 5 0 0 10 0 0
cpu1 200 10 20 2500 5 3 2 40 0 0
cpu2 999 0 0 0 0 0 0 0 0 0
intr 123 0 0
ctxt 456
"""


def test_busy_seconds_counts_the_allowed_cpus_busy_time_steal_included_idle_not():
    # cpu0: user 100 + system 50 + steal 10; cpu1: 200 + nice 10 + 20 + irq 3 + softirq 2 + steal 40
    assert tp.busy_seconds(STAT, {0}, hz=100) == pytest.approx(1.60)
    assert tp.busy_seconds(STAT, {0, 1}, hz=100) == pytest.approx(1.60 + 2.75)
    assert tp.busy_seconds(STAT, {2}, hz=100) == pytest.approx(9.99)  # a CPU outside the set is not counted
    assert tp.busy_seconds(STAT, set(), hz=100) == 0


def test_read_of_an_overflowing_counter_is_no_reading(monkeypatch):
    """A /proc/stat counter too large for a float (400 digits): no reading, no OverflowError (red team)."""
    import builtins
    import io
    real_open = builtins.open
    stat = "cpu0 " + "9" * 400 + " 0 0 0 0 0 0 0\n"
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: io.StringIO(stat) if str(p) == "/proc/stat"
                        else real_open(p, *a, **k))
    assert tp.read({0}) is None


def test_others_are_the_busy_time_this_process_did_not_use_per_second():
    a, b = tp.Reading(10.0, 100.0, 5.0), tp.Reading(12.0, 103.0, 6.0)  # 3 CPU-s busy, 1 of them ours, in 2 s
    assert tp.others_between(a, b) == pytest.approx(1.0)
    assert tp.others_between(a, tp.Reading(12.0, 100.5, 6.0)) == 0  # ticks behind our own clock: never negative
    assert tp.others_between(a, a) == 0  # an empty window says nothing


@pytest.mark.parametrize("others, allowed, most, want", [
    (0.0, 2, 2, 2),   # a quiet machine keeps every thread
    (0.2, 2, 2, 2),   # background noise below BUSY_CORE takes no core
    (0.3, 2, 2, 1),   # more than BUSY_CORE of a core: that core is theirs
    (1.0, 2, 2, 1),   # one busy process on 2 cores
    (3.0, 2, 2, 1),   # never fewer than one
    (1.2, 8, 8, 7),   # a whole core and 0.2 of another
    (1.3, 8, 8, 6),
    (0.0, 8, 4, 4),   # never more than torch had
    (float("inf"), 4, 4, 1),
])
def test_threads_for_leaves_the_cores_others_take(others, allowed, most, want):
    assert tp.threads_for(others, allowed, most) == want


class Readings:
    """A scripted /proc/stat: each read is `step_s` later, the allowed CPUs `busy` cores busy, this process `own`."""

    def __init__(self, busy: float, own: float = 0.0, step_s: float = 1.0) -> None:
        self.busy, self.own, self.step_s = busy, own, step_s
        self.t = self.b = self.o = 0.0
        self.reads = 0

    def __call__(self, cpus=None) -> tp.Reading:
        self.reads += 1
        self.t += self.step_s
        self.b += self.busy * self.step_s
        self.o += self.own * self.step_s
        return tp.Reading(self.t, self.b, self.o)


@pytest.fixture
def four_cores(monkeypatch):
    """Four allowed CPUs, torch at four threads, the governor on; torch's count put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(tp, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(tp, "ADAPT", True)
    monkeypatch.setattr(tp, "_SET", None)
    monkeypatch.setattr(tp, "_BEFORE", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_the_governor_follows_the_load_down_and_back_up_never_above_what_it_found(four_cores, monkeypatch):
    load = Readings(busy=2.5)  # others: 2.5 cores (this process idle)
    monkeypatch.setattr(tp, "read", load)
    gov = tp.Governor()
    assert gov.step() == 1 and torch.get_num_threads() == 1  # 3 cores taken
    load.busy = 1.0
    assert gov.step() == 3 and torch.get_num_threads() == 3
    load.busy = 0.0
    assert gov.step() == 4 and torch.get_num_threads() == 4
    load.busy = 4.0  # this process busy on every core: its own work is no load
    load.own = 4.0
    assert gov.step() == 4
    # the engines with pools of their own open at the count before any governor lowered it
    load.busy, load.own = 3.0, 0.0
    assert gov.step() == 1 and tp.ceiling() == 4
    # a second governor (another batch loop) finds 1 but knows it was a governor's: it may go back to 4
    load.busy = 0.0
    assert tp.Governor().step() == 4
    gov.close()


def test_the_governor_reads_at_most_every_interval(four_cores, monkeypatch):
    load = Readings(busy=2.0, step_s=0.01)
    monkeypatch.setattr(tp, "read", load)
    monkeypatch.setattr(tp, "MIN_WINDOW_S", 0.0)
    gov = tp.Governor(interval_s=1.0)
    assert gov.step() == 2  # the first decision
    load.busy = 0.0
    for _ in range(5):  # 10 ms apart: inside the interval, the count stays
        assert gov.step() == 2
    assert load.reads == 7
    load.step_s = 5.0
    assert gov.step() == 4


def test_a_users_thread_count_is_left_alone(four_cores, monkeypatch):
    monkeypatch.setattr(tp, "read", Readings(busy=3.0))
    gov = tp.Governor(threads=3)  # --threads / run.threads
    assert gov.fixed and gov.step() == 3 and torch.get_num_threads() == 3
    gov.close()
    assert torch.get_num_threads() == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert "OMP_NUM_THREADS" in tp.Governor().fixed and tp.Governor().step() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(tp, "ADAPT", False)
    assert tp.Governor().step() == 4
    monkeypatch.setattr(tp, "ADAPT", True)
    # torch.set_num_threads called while it runs: that count is kept from then on
    gov = tp.Governor()
    assert gov.step() == 1
    torch.set_num_threads(2)
    assert gov.step() == 2 and "set_num_threads" in gov.fixed
    gov.close()
    assert torch.get_num_threads() == 2
    # a count below torch's default is never raised
    torch.set_num_threads(2)
    monkeypatch.setattr(tp, "read", Readings(busy=0.0))
    assert tp.Governor().step() == 2


def test_no_governor_without_proc_stat(four_cores, monkeypatch):
    monkeypatch.setattr(tp, "read", lambda cpus=None: None)
    gov = tp.Governor()
    assert "/proc/stat" in gov.fixed and gov.step() == 4


@pytest.fixture
def load_counts(monkeypatch):
    """Choices measured under load are not cached (conftest turns this off for the other tests)."""
    monkeypatch.setattr(tp, "BUSY_LIMIT", 0.25)


def test_a_gemm_choice_measured_under_load_is_this_process_only(tmp_path, monkeypatch, load_counts, caplog):
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    for name, value in (("FORCE", None), ("_CHOICES", {}), ("_RATES", {}), ("_LOADED", False), ("_UNSAVED", set())):
        monkeypatch.setattr(gemm, name, value)
    monkeypatch.setattr(gemm, "measure", lambda k, n, rows, kind="linear": {"mkl": 1.0, "onednn-packed": 2.0})
    monkeypatch.setattr(tp, "read", Readings(busy=1.5))
    with caplog.at_level("INFO", logger="vitkit"):
        assert gemm.choose(64, 96, 50) == "onednn-packed"
        assert gemm.choose(64, 128, 50) == "onednn-packed"
    assert not list(tmp_path.glob("gemm/*.json"))  # nothing written
    notes = [r.getMessage() for r in caplog.records if "GEMM" in r.getMessage()]
    assert len(notes) == 1 and "for this run only, not cached" in notes[0] and "1.5 of" in notes[0]
    # measured quietly: cached, and the choices made under load are still not written
    monkeypatch.setattr(tp, "read", Readings(busy=0.1))
    gemm.choose(32, 32, 8)
    (saved,) = json.loads(next(tmp_path.glob("gemm/*.json")).read_text())
    assert saved["shape"][:3] == ["linear", 32, 32]


def _tiny():
    torch.manual_seed(0)
    return vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, embed_dim=48, num_heads=3,
                               mlp_dim=96, num_classes=10).eval()


def test_backend_auto_measured_under_load_decides_this_run_only(tmp_path, monkeypatch, load_counts):
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "FORCE", "mkl")
    monkeypatch.setattr(tp, "read", Readings(busy=1.2))
    said = []
    m = _tiny()
    choice = engine.choose(m, 2, candidates=("torch-fp32",), log=said.append, export=None)
    assert choice.name == "torch-fp32" and "measured under load: this run only" in choice.reason
    assert any("--backend auto" in s and "not cached" in s for s in said)
    assert not list(tmp_path.glob("backends/*.json"))
    again = engine.choose(m, 2, candidates=("torch-fp32",), log=said.append, export=None)
    assert "measured earlier" not in again.reason  # measured again: nothing was kept
    monkeypatch.setattr(tp, "read", Readings(busy=0.0))
    engine.choose(m, 2, candidates=("torch-fp32",), log=said.append, export=None)
    assert "measured earlier" in engine.choose(m, 2, candidates=("torch-fp32",), export=None).reason


def test_predict_runs_each_batch_at_the_count_the_load_allows_and_puts_it_back(four_cores, monkeypatch, tmp_path):
    from PIL import Image

    from vitkit.inference.predict import gather_inputs, predict_batches

    monkeypatch.setattr(tp, "read", Readings(busy=2.0))
    m = _tiny()
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append(torch.get_num_threads()))
    for i in range(3):
        Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
    records = [r for batch in predict_batches(m, gather_inputs([str(tmp_path)]), batch_size=2, num_workers=0)
               for r in batch]
    assert len(records) == 3 and seen == [2, 2]  # 2 of 4 cores taken
    assert torch.get_num_threads() == 4


def test_serve_sets_the_count_in_the_models_thread(four_cores, monkeypatch):
    from vitkit.serve import TorchPredictor
    from vitkit.serve.engine import MicroBatcher

    monkeypatch.setattr(tp, "read", Readings(busy=3.0))
    batcher = MicroBatcher(TorchPredictor(_tiny()))
    got = batcher.executor.submit(batcher._locked, torch.get_num_threads).result()
    assert got == 1
    fixed = TorchPredictor(_tiny())
    fixed.threads = 2  # vitkit serve --threads 2
    batcher = MicroBatcher(fixed)
    assert batcher.executor.submit(batcher._locked, torch.get_num_threads).result() == 2


def test_an_exported_engine_that_wins_under_load_must_beat_eager_side_by_side(monkeypatch):
    from vitkit.machine.engine import Candidate

    table = [Candidate("torch-fp32", 10.0, 0.0), Candidate("onnx-fp32", 250.0, 1e-7)]  # eager timed collapsing
    monkeypatch.setattr(engine, "engine", lambda *a: (lambda x: x))
    m = _tiny()
    for eager_s, onnx_s, want in ((0.01, 0.02, "torch-fp32"), (0.02, 0.01, "onnx-fp32")):
        rounds = {"torch-fp32": [eager_s] * 5, "onnx-fp32": [onnx_s] * 5}  # seconds per call, round by round
        monkeypatch.setattr(engine.engine_probe, "interleaved_rounds", lambda fns, r=rounds: r)
        name, why = engine.side_by_side(m, table, "onnx-fp32", "250.0 img/s", 2, None, lambda: Path("m.onnx"))
        assert name == want, why
        assert ("0.50x torch-fp32 side by side" in why) if want == "torch-fp32" else ("2.00x torch-fp32" in why)
    assert m.training is False and not any(getattr(x, "packable", False) for x in m.modules())


@pytest.mark.skipif(engine.installed("aoti") is None, reason="no C++ compiler for Inductor")
def test_a_package_compiled_at_a_lowered_thread_count_runs_at_any_count(tmp_path, monkeypatch):
    """Inductor writes the thread count into a package compiled at any count but the machine's: one compiled while
    the governor had lowered torch's count must still follow the count it runs at."""
    import zipfile

    from vitkit.machine import aoti

    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    before = torch.get_num_threads()
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, embed_dim=64, num_heads=2, mlp_dim=128,
                            num_classes=10).eval()
    torch.set_num_threads(1)
    try:
        out = aoti.compile_package(aoti.Autocast(m, "fp32"), (torch.randn(2, 3, 32, 32),), None, tmp_path / "m.pt2", {})
        assert torch.get_num_threads() == 1  # the caller's count, put back
    finally:
        torch.set_num_threads(before)
    with zipfile.ZipFile(out) as z:
        code = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".cpp"))
    assert "#pragma omp parallel" in code or (os.cpu_count() or 1) == 1
    assert "num_threads(" not in code
