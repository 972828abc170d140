"""Several processes with torch.distributed (gloo on the CPU): DDP and FSDP2 against one process, sharded checkpoints
resumed at another world size, a killed run resumed exactly, evaluation that counts every sample once."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitkit.training import checkpoint

REPO = Path(__file__).resolve().parents[1]
# a tiny plain ViT on scikit-learn's digits, no randomness in the data path: one process and several see the same
TINY = ["fashion-mnist", "data.dataset=digits", "data.batch_size=64", "model.name=vit_ti16",
        'model.overrides={"img_size": 16, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_dim": 128, '
        '"hybrid_layers": null, "classifier": "token"}',
        "aug.hflip=false", "aug.pad=0", "aug.random_erasing=0", "run.tta=none", "run.lowp_stream=false",
        "run.precision=fp32", "run.progress=false", "run.log_every=1", "schedule.warmup_epochs=0.1", "optim.lr=3e-3"]


def _env() -> dict:
    # one GEMM path for every process and run: a rank at half the rows (or a run under another load) may measure
    # another path fastest, whose fp32 rounding differs; the packed path, so that DDP/FSDP2 run it
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VITKIT_GEMM": "onednn-packed"}


def _train(out: Path, *extra: str, nproc: int = 1, check: bool = True, torchrun: bool = False, **kw) -> subprocess.CompletedProcess:
    # torchrun itself runs any number of processes (1 too); `vitkit train --nproc N` relaunches under it for N > 1
    launch = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if torchrun else []) + ["-m", "vitkit"]
    cmd = [sys.executable, *launch, "train", *TINY, f"run.out_dir={out}", *extra]
    cmd += ["--nproc", str(nproc)] if nproc > 1 and not torchrun else []
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300, **kw)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def test_ddp_and_fsdp_match_one_process_at_the_global_batch(tmp_path):
    """2 processes at 32 samples each = 1 process at 64: the same weights after 6 steps, DDP and FSDP2 alike;
    and gradient accumulation (2 x 32, no all-reduce on the first) with activation checkpointing is the same too.
    SGD, whose update is linear in the gradient: AdamW divides by sqrt(v), which turns the fp32 rounding of a
    summed-in-another-order near-zero gradient into differences of up to its learning rate (7e-5 measured)."""
    sgd = ("optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0")
    _train(tmp_path / "one", "--max-steps", "6", *sgd)
    # the ranks straight under torchrun; `vitkit train --nproc 2` (a process more, launching it) runs in the tests below
    _train(tmp_path / "ddp", "--max-steps", "6", *sgd, nproc=2, torchrun=True)
    _train(tmp_path / "fsdp", "--max-steps", "6", "run.strategy=fsdp", *sgd, nproc=2, torchrun=True)
    _train(tmp_path / "accum", "--max-steps", "6", "data.batch_size=32", "run.accumulate=2", "run.activation_checkpointing=true",
           *sgd, nproc=2, torchrun=True)
    # torchrun at one process: DDP and FSDP2 run alone in a group of one (what their overhead is measured on)
    _train(tmp_path / "ddp1", "--max-steps", "6", "run.strategy=ddp", *sgd, torchrun=True)
    _train(tmp_path / "fsdp1", "--max-steps", "6", "run.strategy=fsdp", *sgd, torchrun=True)
    one = tmp_path / "one" / "final.safetensors"
    assert load_file(one)["head.weight"].abs().max() > 0  # it trained
    for name in ("ddp", "fsdp", "accum", "ddp1", "fsdp1"):
        assert _max_diff(one, tmp_path / name / "final.safetensors") <= 1e-5, name
    result = json.loads((tmp_path / "fsdp" / "result.json").read_text())
    assert result["world_size"] == 2 and result["step"] == 6
    assert json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1  # rank 0 alone logs


def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path):
    out = tmp_path / "run"
    _train(out, "--max-steps", "4", "run.ckpt_every=2", "run.strategy=fsdp", nproc=2)
    ck = checkpoint.latest(out)
    assert ck.name == "step-00000004" and checkpoint.read_meta(ck)["world_size"] == 2
    assert sorted(p.name for p in ck.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    res = _train(out, "--max-steps", "7")  # 2 -> 1: resharded
    assert "saved by 2 process(es), in 1" in res.stderr  # a warning, through vitkit.log (75dbcb4)
    assert checkpoint.read_meta(checkpoint.latest(out))["step"] == 7
    _train(out, "--max-steps", "10", nproc=2)  # 1 -> 2
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "split" not in x]
    assert steps == list(range(1, 11))
    # a step folder converts to one .safetensors for inference, equal to the run's final weights
    subprocess.run([sys.executable, "-m", "vitkit", "convert", str(checkpoint.latest(out)), str(tmp_path / "c.safetensors")],
                   check=True, env=_env(), cwd=REPO, capture_output=True)
    assert _max_diff(tmp_path / "c.safetensors", out / "final.safetensors") == 0


def test_a_killed_distributed_run_resumes_to_the_same_weights(tmp_path):
    _train(tmp_path / "ref", "schedule.epochs=3", nproc=2)
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "vitkit", "train", *TINY, f"run.out_dir={cut}", "schedule.epochs=3", "run.ckpt_every=3",
           "--nproc", "2"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            lines = (cut / "metrics.jsonl").read_text().splitlines() if (cut / "metrics.jsonl").exists() else []
            if len(lines) >= 20:
                break
            time.sleep(0.05)
    finally:  # whatever happened above, the launcher ends here, at once; torchrun, in its own session, hears SIGTERM
        os.killpg(proc.pid, signal.SIGKILL)  # from Linux (PR_SET_PDEATHSIG), and the ranks save the step in hand
        proc.wait(30)
    from test_trust_values import _processes_naming

    end = time.monotonic() + 120
    while _processes_naming(f"run.out_dir={cut}") and time.monotonic() < end:  # nothing left writing into `cut`
        time.sleep(0.1)
    assert _processes_naming(f"run.out_dir={cut}") == []
    step = checkpoint.read_meta(checkpoint.latest(cut))["step"]
    assert 0 < step < 69  # 23 steps an epoch, 3 epochs
    _train(cut, "schedule.epochs=3", "run.ckpt_every=3", nproc=2)
    assert _max_diff(tmp_path / "ref" / "final.safetensors", cut / "final.safetensors") == 0


def _run_script(tmp_path: Path, body: str, nproc: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)


def test_distributed_evaluation_counts_every_sample_once(tmp_path):
    """297 test images (odd) over 2 and 3 ranks, batches of 40: the same counts as one process, exactly."""
    import vitkit
    from vitkit.data.datasets import load_dataset
    from vitkit.data.image import EvalTransform
    from vitkit.evaluation import evaluate

    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=8, patch_size=4, in_chans=1, depth=1, embed_dim=32, num_heads=2, mlp_dim=64,
                            num_classes=10, mean=(0.5,), std=(0.5,))
    torch.nn.init.normal_(m.head.weight, std=1.0)
    vitkit.save(m, tmp_path / "m.safetensors")
    test = load_dataset("digits").test
    assert len(test) % 2 == 1
    ref = evaluate(m.eval(), test, EvalTransform.for_model(m.config), batch_size=40)
    for nproc in (2, 3):
        res = _run_script(tmp_path, f"""
            import json, torch, vitkit
            from vitkit.data.datasets import load_dataset
            from vitkit.data.image import EvalTransform
            from vitkit.training.distributed import Dist
            from vitkit.evaluation import evaluate
            dist = Dist.from_env(torch.device("cpu"))
            m = vitkit.load({str(tmp_path / "m.safetensors")!r})
            r = evaluate(m, load_dataset("digits").test, EvalTransform.for_model(m.config), batch_size=40, dist=dist)
            if dist.main:
                print("RESULT", json.dumps(r.to_dict()))
            dist.close()
        """, nproc)
        assert res.returncode == 0, res.stderr[-2000:]
        got = json.loads(res.stdout.split("RESULT", 1)[1])
        assert got["n"] == ref.n == 297 and got["confusion"] == ref.confusion.tolist() and got["acc1"] == ref.acc1
        # fp32 logits of the same images in other batches may round differently (MKL's AVX2 GEMM does): to 1e-6
        # relative; a sample counted twice or missed would move the mean loss by ~1/297
        assert got["loss"] == pytest.approx(ref.loss, rel=1e-6)


def test_ranks_that_disagree_on_the_config_stop_with_a_clear_error(tmp_path):
    res = _run_script(tmp_path, f"""
        import os
        from vitkit.training import get_preset, apply_overrides, train
        cfg = get_preset("fashion-mnist", smoke=True)
        apply_overrides(cfg, {{"data.dataset": "digits", "run.out_dir": {str(tmp_path / "run")!r},
                              "optim.lr": 1e-3 * (1 + int(os.environ["RANK"]))}})
        train(cfg)
    """)
    assert res.returncode != 0
    assert "the ranks disagree on the config" in res.stderr and "Every rank must run the same command" in res.stderr


def test_fsdp_at_low_precision_refuses_batchnorm(tmp_path):
    """FSDP2's mixed precision casts a BatchNorm's weight, not its running statistics, and torch's norm then refuses
    the mix at the first step: a BatchNorm hybrid (or a conv stem) at bf16 under FSDP2 is refused up front; fp32 and
    GroupNorm models are wrapped."""
    import torch.distributed as tdist
    import torch.nn.functional as F

    import vitkit
    from vitkit.errors import UsageError
    from vitkit.training.distributed import Dist, wrap_model

    x = torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)  # the failure the refusal stands for
    with pytest.raises(RuntimeError, match="expected scalar type"):
        F.batch_norm(x, torch.zeros(4), torch.ones(4), torch.ones(4, dtype=torch.bfloat16),
                     torch.zeros(4, dtype=torch.bfloat16), training=True)
    kw = dict(img_size=28, in_chans=1, patch_size=4, hybrid_layers=(1,), hybrid_width=0.5, embed_dim=48, depth=1,
              num_heads=3, mlp_dim=96, num_classes=10)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with pytest.raises(UsageError, match="run.strategy=fsdp at precision bf16 with BatchNorm"):
            wrap_model(vitkit.create_model("r26_vit_s32", hybrid_norm="batch", **kw), Dist(), "fsdp", "bf16")
        wrap_model(vitkit.create_model("r26_vit_s32", hybrid_norm="batch", **kw), Dist(), "fsdp", "fp32")
        wrap_model(vitkit.create_model("r26_vit_s32", **kw), Dist(), "fsdp", "bf16")
    finally:
        tdist.destroy_process_group()
