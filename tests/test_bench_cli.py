"""`vitkit bench` and the CLI's model table: fields present and consistent (timings are measured, never asserted)."""
import json

import pytest

from vitkit.bench import bench_model
from vitkit.machine import gemm
from vitkit.cli import main


@pytest.mark.parametrize("train", [False, True])
def test_bench_reports_consistent_fields(train):
    import vitkit

    from vitkit.models.stats import count_flops

    m = vitkit.create_model("vit_ti16", img_size=32, depth=2, num_classes=10)
    r = bench_model(m, "tiny", batch_size=2, train=train, min_seconds=0.05, iters=2, warmup=1, peak=1e11)
    assert r.img_per_s > 0 and r.gflops_per_img == pytest.approx(count_flops(m, (32, 32)) / 1e9)
    # the work per second it reports is the model's FLOPs (3x with the backward) at the measured rate
    assert r.achieved_tflops == pytest.approx(r.gflops_per_img * (3 if train else 1) * r.img_per_s / 1e3)
    assert (r.latency_ms_b1 is None) == train
    from vitkit.machine.fast_linear import packing_available

    # fp32 on a CPU, inference and training alike run the 2 blocks' 4 Linear layers each, the head and the patch
    # embedding on the GEMM path chosen here; the choices made are reported with the rates they were made on
    assert r.packed_linears == (10 if packing_available() else 0)
    assert r.peak_path == "given" and r.matmul_peak_tflops == pytest.approx(0.1)
    if packing_available():
        assert any("192 x 576" in k for k in r.gemm_choices)  # qkv: 192 -> 3 x 192
        assert all(ch["path"] in (*gemm.PATHS, *gemm.WGRAD_PATHS) and ch["path"] in ch["gflops"] for ch in r.gemm_choices.values())


def test_cli_bench_every_family_and_models_table(capsys):
    for name, size, dtype in (("vit_s32", 64, "auto"), ("r26_vit_s32", 64, "fp32"), ("bit_r50x1", 64, "fp32")):
        assert main(["bench", name, "--img-size", str(size), "--batch-size", "1", "--min-seconds", "0.01", "--json-out",
                     "--num-classes", "3", "--dtype", dtype]) == 0  # auto: the probe's choice (tests/test_precision.py)
        out = json.loads(capsys.readouterr().out)
        assert out["model"] == name and out["img_per_s"] > 0
        # the peak is the fastest path of those measured in the same process, torch.mm among them
        assert "torch.mm" in out["gemm_rates_gflops"] and out["peak_path"] in out["gemm_rates_gflops"]
        assert out["matmul_peak_tflops"] * 1e3 == pytest.approx(max(out["gemm_rates_gflops"].values()), rel=0.01)
    assert main(["models", "--pattern", "vit_b*", "--json-out"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["vit_b8", "vit_b16", "vit_b32"]
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "R50+ViT-B/16" in table and "multiply-add = 2 FLOPs" in table


def test_cli_bench_low_precision_stream(capsys):
    args = ["bench", "vit_s32", "--img-size", "64", "--batch-size", "1", "--min-seconds", "0.01", "--num-classes", "3"]
    assert main(args + ["--dtype", "bf16", "--lowp-stream", "--json-out"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "bf16" and out["compiled"] is False and out["compile_mode"] is None
    assert main(args + ["--dtype", "fp32", "--lowp-stream"]) == 2  # fp32: there is no low-precision stream to keep
    assert "--lowp-stream needs --dtype bf16" in capsys.readouterr().err
    assert main(["bench", "bit_r50x1", "--img-size", "64", "--dtype", "bf16", "--lowp-stream"]) == 2  # a CNN has none


def test_device_names_are_checked(capsys):
    import torch

    from vitkit.machine.device import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="cuda:99"):
        resolve_device("cuda:99")
    if not torch.cuda.is_available():  # the CLI turns the error into one line and exit status 2
        assert main(["bench", "vit_s32", "--img-size", "64", "--device", "cuda", "--min-seconds", "0.01"]) == 2
        assert "sees no CUDA GPU" in capsys.readouterr().err


def test_train_step_benchmark_runs_every_strategy_alone(tmp_path):
    """benchmarks/train_step.py (what `gpu.sh strategies` runs on a GPU) at world size 1 on the CPU: the plain loop,
    DDP and FSDP2 with activation checkpointing each give a row, and a step's measured peak holds at least the
    gradients (ViT-Ti: 5.7M fp32 parameters, 22 MB), so the memory measurement sees real allocations. One GEMM path
    (VITKIT_GEMM), as the trainer's own subprocess tests: the four processes (this script and its three memory
    children) would otherwise each measure every layer shape again whenever a neighbour keeps the CPU busy."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "steps.json"
    res = subprocess.run([sys.executable, str(repo / "benchmarks" / "train_step.py"), "--models", "vit_ti16", "--img-size", "32",
                          "--batch", "2", "--steps", "1", "--warmup", "1", "--rounds", "1", "--checkpointing", "on",
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VITKIT_GEMM": "onednn-packed"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["checkpointing"]) for r in rows] == [("plain", True), ("ddp", True), ("fsdp", True)]
    assert all(r["img_per_s"] > 0 and r["step_peak_mb"] >= 20 for r in rows), rows


def test_time_to_accuracy_refuses_to_relabel_another_machines_file(tmp_path, monkeypatch):
    """`benchmarks/time_to_accuracy.py run --tag T` adds runs to T's file only if the file's runs are this machine's
    (CPU name with its ISA caps, and core count): it once wrote this machine's name over the file's, relabelling every
    earlier run."""
    import importlib.util
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first on it
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "time_to_accuracy.py"
    spec = importlib.util.spec_from_file_location("tta_script", script)
    tta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tta)
    monkeypatch.setattr(tta, "machine", lambda: ("CPU A", 2))
    run = {"preset": "fashion-mnist", "seed": 0, "seconds": 1.0, "precision": "fp32", "points": [], "top1": 0.9}
    f = tmp_path / "t.json"
    cases = {  # the file's cpu, its cores, the run's own cpu -> refused?
        ("CPU A", 2, "CPU A"): False,
        ("CPU A", 2, None): False,  # a run without a name is the file's
        ("CPU B", 2, None): True,
        ("CPU A (capped: ONEDNN_MAX_CPU_ISA=AVX2)", 2, None): True,
        ("CPU A", 4, "CPU A"): True,
        ("CPU A", 2, "CPU B"): True,
        (None, 2, None): True,  # runs of no named machine
    }
    for (name, cores, run_cpu), refused in cases.items():
        doc = {"runs": [{**run, **({"cpu": run_cpu} if run_cpu else {})}], "cores": cores, **({"cpu": name} if name else {})}
        f.write_text(json.dumps(doc))
        if refused:
            with pytest.raises(SystemExit, match="pass another --tag"):
                tta.results_doc(f, fresh=False)
        else:
            out = tta.results_doc(f, fresh=False)
            assert out["cpu"] == "CPU A" and out["runs"] == doc["runs"]
        assert json.loads(f.read_text()) == doc  # never rewritten by the check
    f.write_text(json.dumps({"runs": [], "cpu": "CPU B", "cores": 8}))  # no runs yet: this machine's
    assert tta.results_doc(f, fresh=False)["cpu"] == "CPU A"
    assert tta.results_doc(tmp_path / "absent.json", fresh=False) == {"runs": [], "cpu": "CPU A", "cores": 2}
    assert tta.results_doc(f, fresh=True)["runs"] == []  # --smoke: never read
    for existing in sorted((script.parent / "results").glob("time_to_accuracy_*.json")):  # the shipped files
        doc = json.loads(existing.read_text())
        monkeypatch.setattr(tta, "machine", lambda: (doc["cpu"], doc.get("cores") or 2))
        if doc.get("cores"):  # take more runs of their own machine
            assert tta.results_doc(existing, fresh=False)["runs"] == doc["runs"]
        else:  # written before the files named their cores: closed
            with pytest.raises(SystemExit, match="pass another --tag"):
                tta.results_doc(existing, fresh=False)
