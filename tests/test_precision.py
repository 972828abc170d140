"""run.precision=auto: the measured choice, its cache, a probe that changes nothing, the AVX2 caps, hidden ops;
and the model a run builds is the one it names."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitkit
from vitkit.machine import precision
from vitkit.errors import UsageError
from vitkit.training import apply_overrides, checkpoint, get_preset, train

from test_training import tiny_cfg

REPO = Path(__file__).resolve().parents[1]
AVX2_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def _tiny_vit(**kw):
    return vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_dim=128,
                               num_classes=10, **kw)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VITKIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_explicit_precisions_are_obeyed_and_bad_ones_refused(home):
    m = _tiny_vit()
    for p in ("fp32", "bf16"):
        c = precision.resolve(p, m, "cpu", batch=8, training=True)
        assert (c.precision, c.reason) == (p, f"{p}: asked for")
    assert not (home / "precision").exists()  # nothing measured
    with pytest.raises(UsageError, match="fp16 needs a GPU"):
        precision.resolve("fp16", m, "cpu", batch=8, training=True)
    with pytest.raises(UsageError, match="use one of auto, fp32, bf16, fp16"):
        precision.resolve("fp64", m, "cpu", batch=8, training=True)


@pytest.fixture
def native(monkeypatch):
    """A CPU that computes bf16 natively, whatever this one does: the probe runs (the gate is tested on its own)."""
    monkeypatch.setattr(precision, "bf16_support", lambda: (True, "this CPU has bf16 instructions"))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_auto_takes_the_faster_measured_precision_and_caches_it(home, native, training):
    m = _tiny_vit()
    c = precision.resolve("auto", m, "cpu", batch=256, training=training, lowp_stream=True)
    r32, r16, rounds = c.rates["fp32"], c.rates["bf16"], c.rates["rounds"]
    assert r32 > 0 and r16 > 0 and c.rates["batch"] == precision.PROBE_BATCH
    choice, v = precision.decide(rounds["fp32"], rounds["bf16"])
    assert c.precision == choice and v["rounds"] in (1, 3, precision.PROBE_ROUNDS)
    assert c.reason.startswith(f"auto -> {c.precision}: bf16 {v['ratio']:.2f}x fp32 on this CPU (")
    assert f"{r16:.0f} vs {r32:.0f} img/s in their median rounds" in c.reason
    [cache] = (home / "precision").glob("*.json")
    assert vitkit.machine.cpu.cpu_name().split("-")[0] in cache.name and f"t{torch.get_num_threads()}" in cache.name
    # the next process reads the file: nothing measured again, the same choice, said so
    precision._CHOICES.clear()
    again = precision.resolve("auto", m, "cpu", batch=256, training=training, lowp_stream=True)
    assert again.precision == c.precision and again.rates == c.rates and "measured earlier" in again.reason
    # another batch size or mode is another measurement
    other = precision.resolve("auto", m, "cpu", batch=4, training=not training)
    assert other.rates["batch"] == 4 and len(json.loads(cache.read_text())) == 2


def test_the_probe_changes_nothing_it_measures(home):
    """Weights, gradients, train/eval mode, the token-stream flag, packing and the global random state are as before
    the probe: a run that probed and one that read the cache take the same steps."""
    m = _tiny_vit(drop_path_rate=0.1).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    precision.measure(m, torch.device("cpu"), batch=4, training=True, lowp_stream=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert not m.training and m.lowp_stream is False
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    from vitkit.machine.fast_linear import FastGemm

    assert not any(mod.packable or mod._packed for mod in m.modules() if isinstance(mod, FastGemm))


def test_a_bf16_failure_makes_auto_fp32(home, native, monkeypatch):
    """A build or device whose bf16 kernels fail is measured as having none: auto falls back to fp32, saying why."""
    m = _tiny_vit()
    real = torch.autocast

    class Broken(real):
        def __enter__(self):
            if self.fast_dtype == torch.bfloat16:
                raise RuntimeError("no bf16 kernels in this build")
            return super().__enter__()

    monkeypatch.setattr(torch, "autocast", Broken)
    c = precision.resolve("auto", m, "cpu", batch=4, training=True)
    assert c.precision == "fp32" and "bf16 does not run on this CPU (no bf16 kernels in this build)" in c.reason


def _run_python(code: str, env_extra: dict, home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VITKIT_HOME": str(home), "OMP_NUM_THREADS": "2", **env_extra}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CHOICE_CODE = """
import json, torch, vitkit
from vitkit.machine import cpu, gemm, precision, threads
threads.BUSY_LIMIT = float("inf")  # cached whatever else the machine runs (as conftest does in-process)
m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10)
c = precision.resolve("auto", m, "cpu", batch=32, training=True)
paths = {p: gemm.choose(64, 128, 512) for p in ["linear"]} | {"wgrad": gemm.choose(64, 128, 512, kind="wgrad")}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "caps": cpu.isa_caps(), "precision": c.precision,
                  "bf16_native": cpu.bf16_native(), "flags": cpu.cpu_info().get("flags", "").split(),
                  "reason": c.reason, "rates": c.rates, "gemm": paths, "gemm_rates": gemm.choices()}))
"""


def test_choices_under_the_avx2_caps_are_their_own(home):
    """An AVX-512 machine capped to AVX2 (oneDNN, MKL and ATen) makes its own GEMM choices, in cache files of their
    own, each the fastest of its own measurements; its precision is fp32 without a probe (oneDNN capped to AVX2
    emulates bf16), where the uncapped process measures it if the CPU has bf16 instructions."""
    capped = _run_python(CHOICE_CODE, AVX2_CAPS, home)
    native = _run_python(CHOICE_CODE, {k: "" for k in AVX2_CAPS}, home)
    assert capped["capability"] == "AVX2" and capped["caps"] == ",".join(f"{k}={v}" for k, v in AVX2_CAPS.items())
    assert native["caps"] == "" and capped["bf16_native"] is False  # oneDNN capped to AVX2 emulates bf16
    assert native["bf16_native"] == bool({"avx512_bf16", "amx_bf16"} & set(native["flags"]))
    assert capped["precision"] == "fp32" and capped["rates"] == {} and "not measured" in capped["reason"]
    if native["bf16_native"]:
        r = native["rates"]["rounds"]
        assert native["precision"] == precision.decide(r["fp32"], r["bf16"])[0], native
    else:
        assert native["precision"] == "fp32" and native["rates"] == {}
    for res in (capped, native):
        for shape, ch in res["gemm_rates"].items():
            assert ch["path"] == max(ch["gflops"], key=ch["gflops"].get), (shape, ch)
    names = sorted(p.name for p in (home / "gemm").glob("*.json"))
    assert len(names) == 2 and sum("caps-ONEDNN_MAX_CPU_ISA_AVX2" in n for n in names) == 1, names
    names = sorted(p.name for p in (home / "precision").glob("*.json"))  # the capped process measured nothing
    assert names == ([n for n in names if "caps-" not in n] if native["bf16_native"] else []) and \
        len(names) == int(native["bf16_native"]), names


# ---- the decision: interleaved rounds, a median of ratios, bf16 only where it wins clearly (issue 42, item 8) ----

def _rounds(ratios, fp32=0.010):
    """fp32 and bf16 seconds per call whose per-round speed-ups (fp32 / bf16) are `ratios`."""
    return [fp32] * len(ratios), [fp32 / r for r in ratios]


@pytest.mark.parametrize("ratios, expected", [
    ([1.02, 0.97, 1.01, 1.40, 0.99], "fp32"),  # noise, one round favouring bf16 by 1.40x: kept fp32
    ([0.20, 0.31, 0.25, 2.90, 0.18], "fp32"),  # emulated bf16 on a busy machine, one lucky round
    ([1.10, 1.12, 1.15, 1.09, 1.13], "fp32"),  # faster in every round, but not clearly
    ([1.50, 0.80, 1.45, 0.70, 1.60], "fp32"),  # a median of 1.45x that two rounds of five contradict
    ([1.45, 1.52, 1.38, 1.60, 1.49], "bf16"),  # a clear win in every round
    ([1.45, 1.52, 0.90, 1.60, 1.49], "bf16"),  # a clear win in four of five
    ([1.30, 1.25, 1.28], "bf16"),  # three rounds of a slow call, all agreeing
    ([1.30, 0.95, 1.28], "fp32"),  # ... not all agreeing
    ([0.30], "fp32"),  # bf16's first call 3x slower: not timed further
])
def test_decide_keeps_fp32_unless_bf16_wins_clearly(ratios, expected):
    choice, v = precision.decide(*_rounds(ratios))
    assert choice == expected, v
    assert v["rounds"] == len(ratios) and v["wins"] == sum(r > 1 for r in ratios)
    assert v["ratio"] == pytest.approx(sorted(ratios)[len(ratios) // 2])  # the median of an odd count
    assert (v["low"], v["high"]) == pytest.approx((min(ratios), max(ratios)))


def test_decide_on_nothing_measured_and_a_bad_time_is_fp32():
    assert precision.decide([], [])[0] == "fp32"
    assert precision.decide([0.01, 0.0], [0.005, 0.005])[1]["rounds"] == 1  # a zero time is no round
    assert precision.decide([0.01], [0.005])[0] == "fp32"  # one round, however clear, decides nothing
    assert precision.decide([0.01, 0.01], [0.005, 0.005])[0] == "fp32"
    assert precision.decide([0.01] * 3, [0.005] * 3)[0] == "bf16"


def test_the_reason_line_says_the_numbers(home, monkeypatch):
    """The rounds a probe measured decide, and the reason line names the median, the spread, the wins, and what
    bf16 would have needed."""
    fp32, bf16 = _rounds([1.02, 0.97, 1.01, 1.40, 0.99], fp32=0.008)
    monkeypatch.setattr(precision, "bf16_support", lambda: (True, "native"))
    monkeypatch.setattr(precision, "measure", lambda *a, batch, **k: {
        "fp32": batch / 0.008, "bf16": batch / sorted(bf16)[2], "rounds": {"fp32": fp32, "bf16": bf16}, "batch": batch,
        "mode": "eval"})
    c = precision.resolve("auto", _tiny_vit(), "cpu", batch=1, training=False)
    assert c.precision == "fp32" and c.reason == (
        "auto -> fp32: bf16 1.01x fp32 on this CPU (median of 5 interleaved rounds, 0.97-1.40x, bf16 the faster in 3 "
        "of 5; bf16 is taken at 1.20x and the faster in 4 of 5; 126 vs 125 img/s in their median rounds, forward, "
        "batch 1)")


def test_interleaved_rounds_alternate_the_order_after_warm_up():
    from vitkit.machine.engine_probe import interleaved_rounds

    calls = []
    times = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=4,
                               min_round_s=0.0)
    assert calls == ["a", "b", "a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, sizing, 4 rounds
    assert [len(t) for t in times.values()] == [4, 4]


# ---- no native bf16: fp32 without a probe --------------------------------------------------------------------

AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c"


@pytest.mark.parametrize("info, native", [
    ({"flags": AVX2_FLAGS}, False),  # the AVX2-only CPU
    ({"flags": AVX2_FLAGS + " avx512f avx512_bf16"}, True),
    ({"flags": AVX2_FLAGS + " amx_bf16 amx_tile"}, True),
    ({"Features": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics"}, False),  # Arm without bf16
    ({"Features": "fp asimd sve bf16 i8mm"}, True),
    ({}, None),  # nothing to go by: the probe decides
])
def test_the_native_bf16_gate(monkeypatch, info, native):
    from vitkit.machine import cpu

    monkeypatch.setattr(cpu, "cpu_info", lambda: info)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert precision.bf16_support()[0] is native


def test_no_native_bf16_keeps_fp32_without_a_probe_unless_bf16_is_named(home, monkeypatch, capsys):
    from vitkit.machine import cpu
    from vitkit.machine import engine as backends

    monkeypatch.setattr(cpu, "cpu_info", lambda: {"flags": AVX2_FLAGS})
    monkeypatch.setattr(precision, "measure", lambda *a, **k: pytest.fail("measured on a CPU without native bf16"))
    m = _tiny_vit()
    c = precision.for_inference(m, "cpu", "auto", batch=1)
    assert c.precision == "fp32" and c.reason == (
        "auto -> fp32: this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16 in its flags): bf16 would be "
        "emulated, several times slower; not measured (precision bf16 by name still runs it)")
    assert f"vitkit: precision {c.reason}" in capsys.readouterr().err and not (home / "precision").exists()
    assert precision.resolve("bf16", m, "cpu", batch=1, training=False).precision == "bf16"
    # --backend auto: the bf16 engines are compared (torch-bf16's logits) but not timed, unless bf16 is named
    table = backends.measure(m, 2, candidates=("torch-fp32", "torch-bf16", "openvino-bf16"))
    t = {c.name: c for c in table}
    assert t["torch-fp32"].rate > 0 and not t["torch-fp32"].skipped
    assert t["torch-bf16"].error is not None and t["torch-bf16"].rate == 0
    assert t["torch-bf16"].skipped.startswith("not timed: this CPU has no native bf16")
    assert t["openvino-bf16"].skipped.startswith("not measured: this CPU has no native bf16")
    assert backends.pick(table)[0] == "torch-fp32"
    forced = {c.name: c for c in backends.measure(m, 2, candidates=("torch-fp32", "torch-bf16"), force_bf16=True)}
    assert forced["torch-bf16"].rate > 0 and not forced["torch-bf16"].skipped.startswith("not timed")


def test_backend_auto_keeps_torch_bf16_only_where_it_wins_clearly(home, native, monkeypatch):
    """torch-fp32 and torch-bf16 are timed in the same interleaved rounds and judged by `decide`."""
    from vitkit.machine import engine as backends
    from vitkit.machine import engine_probe

    for ratios, kept in (([1.02, 0.97, 1.01, 1.40, 0.99], False), ([1.45, 1.52, 1.38, 1.60, 1.49], True)):
        fp32, bf16 = _rounds(ratios)
        monkeypatch.setattr(engine_probe, "interleaved_rounds", lambda fns, **k: {"torch-fp32": fp32, "torch-bf16": bf16})
        t = {c.name: c for c in backends.measure(_tiny_vit(), 2, candidates=("torch-fp32", "torch-bf16"))}
        assert t["torch-fp32"].rate == pytest.approx(2 / 0.010) and t["torch-bf16"].rate == pytest.approx(2 / sorted(bf16)[2])
        assert (not t["torch-bf16"].skipped) == kept, t["torch-bf16"]
        if not kept:
            assert t["torch-bf16"].skipped == ("not clearly faster than torch-fp32 (1.01x, median of 5 interleaved "
                                               "rounds, the faster in 3; needs 1.20x in 4)")


HIDDEN_OPS_CODE = """
import json, torch
torch.backends.mkldnn.is_available = lambda: False   # as a build without oneDNN (some aarch64 wheels)
torch.backends.mkl.is_available = lambda: False      # and without MKL
from vitkit.machine import fast_linear as linear, gemm
from vitkit.training import get_preset, apply_overrides, train
cfg = get_preset("fashion-mnist", smoke=True)
# the smoke run's transformer without the preset's ResNet stem: its convolutions never reach the GEMM paths checked
# here, and they made the precision probe (batch 32, forward and backward) the bulk of this test
apply_overrides(cfg, {"data.dataset": "digits", "model.name": "vit_ti16", "model.overrides": {"img_size": 16, "patch_size": 4,
                "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}, "run.out_dir": OUT, "run.progress": False})
res = train(cfg, max_steps=3)
print(json.dumps({"packing": linear.packing_available(), "paths": [p for p in gemm.PATHS if gemm.available(p)],
                  "step": res["step"], "choice": json.load(open(OUT + "/result.json")) and
                  __import__("yaml").safe_load(open(OUT + "/config.yaml"))["run"]["precision_choice"]}))
"""


def test_a_torch_without_onednn_and_mkl_ops_falls_back_cleanly(home, tmp_path):
    res = _run_python(f"OUT = {str(tmp_path / 'run')!r}\n" + HIDDEN_OPS_CODE, {}, home)
    assert res["packing"] is False and res["paths"] == ["mkl"]  # plain F.linear alone
    assert res["step"] == 3 and res["choice"].startswith("auto -> ")


def test_a_run_records_its_auto_choice_and_resumes_in_it(tmp_path, home, capsys, monkeypatch):
    monkeypatch.setattr(precision, "bf16_support", lambda: (True, "native"))  # a probe runs, on any CPU
    out = tmp_path / "run"
    cfg = tiny_cfg(out, **{"run.precision": "auto", "schedule.epochs": 1})
    train(cfg, max_steps=2)
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())["run"]
    assert saved["precision"] == "auto" and saved["precision_choice"].startswith("auto -> ")
    chosen = checkpoint.resolved_precision({"run": saved})
    assert chosen in ("fp32", "bf16") and f"precision {saved['precision_choice']}" in capsys.readouterr().err
    # the resumed run keeps the first choice, whatever a probe would say now
    (home / "precision").rename(tmp_path / "moved")
    train(tiny_cfg(out, **{"run.precision": "auto", "schedule.epochs": 1}), max_steps=3)
    err = capsys.readouterr().err
    assert f"precision auto -> {chosen}: the choice of the run being resumed" in err
    assert not (home / "precision").exists()  # nothing probed
    # a run saved with an explicit precision resumes under auto without counting it as a change
    assert checkpoint.config_differences({"run": {"precision": "bf16"}}, {"run": {"precision": "auto"}}) == []
    assert checkpoint.config_differences({"run": {"precision": "bf16"}}, {"run": {"precision": "fp32"}})


def test_naming_a_model_drops_the_presets_model_overrides(capsys):
    cfg = get_preset("fashion-mnist")
    assert cfg.model.name == "r26_vit_s32" and cfg.model.overrides["hybrid_layers"] == (4,)
    # edits before the name in the list still apply: the name's reset comes first
    apply_overrides(cfg, {"model.overrides.depth": 3, "model.name": "vit_ti16"})
    assert cfg.model.overrides == {"depth": 3}
    assert "its model overrides are dropped (hybrid_layers=(4,)" in capsys.readouterr().err
    # the same name keeps them; a dict replaces them; KEY=V edits one; null clears
    cfg = get_preset("fashion-mnist")
    apply_overrides(cfg, {"model.name": "r26_vit_s32", "model.overrides.depth": 2})
    assert cfg.model.overrides["hybrid_layers"] == (4,) and cfg.model.overrides["depth"] == 2
    apply_overrides(cfg, {"model.overrides": '{"embed_dim": 64}'})
    assert cfg.model.overrides == {"embed_dim": 64}
    apply_overrides(cfg, {"model.overrides": "null"})
    assert cfg.model.overrides == {}
    with pytest.raises(UsageError, match="not a mapping"):
        apply_overrides(cfg, {"model.overrides": "[1, 2]"})


def test_smoke_of_a_named_model_trains_that_model_small(tmp_path):
    from vitkit.cli import main

    out = tmp_path / "smoke"
    assert main(["train", "fashion-mnist", "--smoke", "model.name=vit_ti16", "model.overrides.patch_size=4",
                 "model.overrides.depth=1", "data.dataset=digits", "model.overrides.img_size=16", f"run.out_dir={out}",
                 "run.progress=false", "--max-steps", "2"]) == 0
    m = vitkit.load(out / "final.safetensors")
    c = m.config
    assert c.hybrid_layers is None and c.classifier == "token" and c.depth == 1 and c.embed_dim == 32  # smoke's width


@pytest.mark.parametrize("info, name", [
    # two VMs of this project that /proc/cpuinfo names alike: without AMX flags (model 207) and with them (167)
    ({"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "207"},
     "Intel(R) Xeon(R) Processor, family 6, model 207"),
    ({"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "167"},
     "Intel(R) Xeon(R) Processor, family 6, model 167"),
    ({"model name": "AMD EPYC 9R45", "cpu family": "26"}, "AMD EPYC 9R45, family 26"),
    ({}, "unknown CPU, family ?"),
    ({"CPU implementer": "0x41", "CPU part": "0xd0c"}, "unknown CPU, family ?"),  # aarch64: no family, no model
    ({"cpu": "POWER9 (raw), altivec supported", "model": "8335-GTH"}, "unknown CPU, family ?"),  # ppc64le: the board
])
def test_the_cpu_every_speed_is_printed_beside_is_named_to_its_model(monkeypatch, info, name):
    from vitkit.machine import cpu

    monkeypatch.setattr(cpu, "cpu_info", lambda: info)
    assert cpu.cpu_model() == name
