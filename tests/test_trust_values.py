"""Issue 52, values from outside: environment knobs parsed in one place (`vitkit.env`), config and checkpoint values
that would give non-finite outputs or be truncated refused by name, and Ctrl-C in `vitkit train` losing no work."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.cli import main
from vitkit.errors import CheckpointError, UsageError, VitkitError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(vitkit.__file__).resolve().parent  # the vitkit under test (PYTHONPATH may name another checkout)


# ---- 1. environment knobs -----------------------------------------------------------------------------------------

def _py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent), **env})


def test_import_and_help_work_whatever_the_environment_holds():
    """`VITKIT_MAX_IMAGE_PIXELS=abc` made `import vitkit` (and so `vitkit --help`) raise a ValueError."""
    bad = {"VITKIT_MAX_IMAGE_PIXELS": "abc", "VITKIT_MAX_TENSOR_BYTES": "1.5", "VITKIT_MAX_DOWNLOAD_BYTES": "x",
           "VITKIT_GEMM": "fast"}
    r = _py("import vitkit, vitkit.cli, vitkit.data.image, vitkit.download, vitkit.machine.gemm\n"
            "try:\n    vitkit.cli.main(['--help'])\nexcept SystemExit as e:\n    raise SystemExit(e.code)", **bad)
    assert r.returncode == 0 and "COMMAND" in r.stdout, r.stderr[-1500:]


BAD_KNOBS = [  # (variable, value, what the one line says it must be)
    ("VITKIT_FETCH_DEADLINE_S", "abc", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "-1", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "1e999", "a finite number in (0, "),
    ("VITKIT_FETCH_DEADLINE_S", "nan", "a finite number in (0, "),
    ("VITKIT_FETCH_MIN_RATE", "0", "a finite number in [1, "),
    ("VITKIT_MAX_IMAGE_PIXELS", "abc", "an integer >= 1"),
    ("VITKIT_MAX_TENSOR_BYTES", "1.5", "an integer >= 1"),
    ("VITKIT_MAX_TEXT_BYTES", "-5", "an integer >= 1"),
    ("VITKIT_MAX_NESTING", "0", "an integer in [1, "),
    ("VITKIT_MAX_DOWNLOAD_BYTES", "64G", "an integer >= 1"),
    ("VITKIT_GEMM", "fast", "one of mkl, mkl-packed, onednn-packed"),
]


@pytest.mark.parametrize("name,value,must", BAD_KNOBS, ids=[f"{n}={v}" for n, v, _ in BAD_KNOBS])
def test_a_command_refuses_a_bad_knob_by_name_before_any_work(monkeypatch, capsys, name, value, must):
    """`vitkit COMMAND` with a bad knob: one line naming the variable, its value and what it must be, exit 2, before
    the command ran (was: a traceback at import, or the default used silently)."""
    monkeypatch.setenv(name, value)
    code = main(["models", "--pattern", "vit_ti16", "--json-out"])
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"vitkit: error: {name}={value!r}: must be {must}"), err
    assert cap.out == ""  # nothing listed: refused before the command's work


def test_knobs_are_read_when_used_and_a_bad_one_is_refused_there(monkeypatch, tmp_path):
    from vitkit.data.image import ImageDecodeError, load_image
    from vitkit.safety import check_tensor, fetch_budget

    monkeypatch.setenv("VITKIT_MAX_TENSOR_BYTES", "1024")  # set after import: read at use
    with pytest.raises(CheckpointError, match="over the limit of 1.0 KiB|VITKIT_MAX_TENSOR_BYTES"):
        check_tensor("w", (1000,), 4, "f.safetensors")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    monkeypatch.setenv("VITKIT_MAX_IMAGE_PIXELS", "10")
    with pytest.raises(ImageDecodeError, match="8 x 8 = 64 pixels, over the limit of 10"):
        load_image(tmp_path / "a.png")
    for name, value in (("VITKIT_FETCH_DEADLINE_S", "1e999"), ("VITKIT_FETCH_MIN_RATE", "0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=rf"^{name}='{value}': must be a finite number"):
            fetch_budget(10)
        monkeypatch.delenv(name)
    monkeypatch.setenv("VITKIT_MAX_IMAGE_PIXELS", "many")
    with pytest.raises(UsageError, match="^VITKIT_MAX_IMAGE_PIXELS='many': must be an integer >= 1"):
        load_image(tmp_path / "a.png")


def test_a_forced_gemm_path_is_checked_against_the_choices(monkeypatch):
    from vitkit import env
    from vitkit.machine import gemm

    assert env.KNOBS["VITKIT_GEMM"].choices == gemm.PATHS
    monkeypatch.setattr(gemm, "FORCE", "fastest")  # the attribute tests set, checked as the variable is
    with pytest.raises(UsageError, match="^VITKIT_GEMM='fastest': must be one of mkl, mkl-packed, onednn-packed"):
        gemm.choose(64, 64, 8)
    monkeypatch.setattr(gemm, "FORCE", gemm.FROM_ENV)
    monkeypatch.setenv("VITKIT_GEMM", "mkl")  # the variable, read at use
    assert gemm.choose(64, 64, 8) == "mkl"


def test_every_knob_the_package_names_is_in_the_table_and_the_docs_show_the_table():
    from vitkit import env

    named, direct = set(), []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"(?<!\w)VITKIT_[A-Z_]+[A-Z]", text))
        if path.name != "env.py":  # the one place that reads them
            direct += [f"{path.name}: {m}" for m in re.findall(r"(?:environ|getenv)[^\n]{0,12}VITKIT_\w+", text)]
    assert named <= set(env.KNOBS), named - set(env.KNOBS)
    assert not direct, direct
    doc = (REPO / "docs" / "safety.md").read_text()
    shown = doc.split("<!-- env-knobs: generated by vitkit.env.markdown_table() -->\n", 1)[1].split("\n<!--", 1)[0]
    assert shown == env.markdown_table(), "docs/safety.md's table: regenerate it from vitkit.env.markdown_table()"
    for knob in env.KNOBS.values():  # every default passes its own check
        assert env.parse(knob.name, None) == env.parse(knob.name, str(knob.default) if knob.default is not None else None)


# ---- 3. values that truncate or give non-finite outputs -----------------------------------------------------------

TRUNCATED = [  # (key, value as typed or as a file holds it): each was accepted, truncated or non-finite
    ("data.batch_size", "4.7"), ("data.batch_size", 4.7), ("model.lora", "2.5"), ("model.lora", 2.5),
    ("run.ckpt_every", "1.5"), ("data.batch_size", "true"), ("run.fewshot_shots", "[1.5]"), ("data.classes", "[0, 1.5]"),
    ("optim.betas", "[0.9, .nan]"), ("optim.betas", "[0.9, .inf]"), ("aug.hflip", "2"),
]


@pytest.mark.parametrize("key,value", TRUNCATED, ids=[f"{k}={v!r}" for k, v in TRUNCATED])
def test_a_training_value_that_would_be_truncated_or_non_finite_is_refused_by_name(key, value):
    from vitkit.training import TrainConfig, apply_overrides, get_preset

    with pytest.raises(UsageError, match=re.escape(key)):
        apply_overrides(get_preset("fashion-mnist"), {key: value})
    section, field = key.split(".")
    with pytest.raises(UsageError, match=re.escape(key)):  # a config file's value, as YAML or JSON holds it
        TrainConfig.from_dict({section: {field: value if not isinstance(value, str) else
                                         __import__("yaml").safe_load(value)}})


def test_the_train_command_refuses_a_fractional_rank_before_any_work(capsys, tmp_path):
    """`vitkit train model.lora=2.5` trained at rank 2; `data.batch_size=4.7` at 4."""
    for bad in ("model.lora=2.5", "data.batch_size=4.7", "data.batch_size=nan", "optim.lr=1e999"):
        code = main(["train", "fashion-mnist", "--smoke", bad, f"run.out_dir={tmp_path / 'run'}", "--print-config"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith(f"vitkit: error: {bad.split('=')[0]}="), err
    assert not (tmp_path / "run").exists()
    assert main(["train", "fashion-mnist", "--smoke", "data.batch_size=4.0", "--print-config"]) == 0  # whole: fine
    assert "batch_size: 4\n" in capsys.readouterr().out


FIXTURES = REPO / "tests" / "fixtures" / "backbones"


def _folder(tmp_path, name: str, edit) -> Path:
    import shutil

    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    return d


HF_DINOV3 = [("rope_theta", 0.0, "rope_temperature"), ("rope_theta", -1.0, "rope_temperature"),
             ("layer_norm_eps", -1.0, "norm_eps"), ("layer_norm_eps", 0.0, "norm_eps")]


@pytest.mark.parametrize("key,value,field", HF_DINOV3, ids=[f"{k}={v}" for k, v, _ in HF_DINOV3])
def test_a_transformers_dinov3_config_with_a_value_that_gives_nan_is_refused(tmp_path, key, value, field):
    """transformers' config.json of DINOv3 with rope_theta 0 or -1, or layer_norm_eps -1 or 0: loaded, and its
    outputs were NaN (checked here: the unrefused model's features are not all finite)."""
    d = _folder(tmp_path, "hf_dinov3", lambda c: c.__setitem__(key, value))
    with pytest.raises(VitkitError, match=rf"{re.escape(str(d))}: ViTConfig\.{field}={value}: must be a number in"):
        m = vitkit.load(d)
        with torch.no_grad():  # what it gave (unfixed): NaN, from a file that loaded without a word
            assert torch.isfinite(m.forward_features(torch.rand(1, 3, 64, 64) * 0)).all()


def test_a_timm_config_and_create_model_kwargs_with_such_values_are_refused(tmp_path):
    d = _folder(tmp_path, "timm_dinov3_s16", lambda c: c["model_args"].__setitem__("rope_temperature", 0.0))
    with pytest.raises(VitkitError, match=r"ViTConfig\.rope_temperature=0\.0: must be a number in"):
        vitkit.load(d)
    for name, kw, field in [("dinov3_s16", {"rope_temperature": -5.0}, "rope_temperature"),
                            ("vit_ti16", {"norm_eps": -1.0}, "norm_eps"),
                            ("vit_ti16", {"drop_path_rate": 1.0}, "drop_path_rate"),  # DropPath divides by 1 - rate
                            ("vit_ti16", {"std": (0.0, 0.5, 0.5)}, "std"),  # the preprocessing divides by it
                            ("swin_t", {"mlp_ratio": 0.0}, "mlp_ratio"),
                            ("bit_r50x1", {"gn_eps": 0.0}, "gn_eps")]:
        with pytest.raises(UsageError, match=rf"Config\.{field}=.*: must be "):
            vitkit.create_model(name, **kw)


def test_a_vitkit_file_whose_config_gives_nan_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=16, depth=1, num_classes=3)
    vitkit.save(m, tmp_path / "ok.safetensors")
    with safe_open(str(tmp_path / "ok.safetensors"), "pt") as f:
        meta, sd = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads(meta["config"])
    cfg["norm_eps"] = -1.0
    save_file(sd, tmp_path / "bad.safetensors", metadata={**meta, "config": json.dumps(cfg)})
    with pytest.raises(VitkitError, match=r"bad\.safetensors.*ViTConfig\.norm_eps=-1\.0: must be a number in"):
        vitkit.load(tmp_path / "bad.safetensors")


def test_a_tensor_of_the_wrong_shape_for_the_config_is_refused_naming_it(tmp_path):
    """Meta's DINOv3 release with a 3-element `qkv.bias_mask` loaded (the mask broadcast over the bias); query and
    key projections of 80 and 48 rows fused into a qkv of the right 192 rows, their rows mixed."""
    from safetensors.torch import load_file, save_file

    w = torch.load(FIXTURES / "timm_dinov3_s16" / "release.pth", weights_only=True)
    w["blocks.0.attn.qkv.bias_mask"] = torch.ones(3)
    torch.save(w, tmp_path / "release.pth")
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.qkv\.bias_mask: shape \(3,\), expected \(192,\)"):
        vitkit.load(tmp_path / "release.pth", num_heads=4)
    d = _folder(tmp_path, "hf_dinov3", lambda c: None)
    sd = load_file(d / "model.safetensors")
    q, k = sd["layer.0.attention.q_proj.weight"], sd["layer.0.attention.k_proj.weight"]
    both = torch.cat([q, k])
    sd["layer.0.attention.q_proj.weight"], sd["layer.0.attention.k_proj.weight"] = both[:80], both[80:]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layer\.0\.attention\.q_proj\.weight \(80, 64\).*\(48, 64\)"):
        vitkit.load(d)


def test_dense_feature_strides_that_ask_for_huge_maps_are_refused_before_allocating():
    m = vitkit.create_model("vit_ti16", img_size=32, depth=1, num_classes=0)
    x = torch.zeros(1, 3, 32, 32)
    with pytest.raises(UsageError, match=r"strides: stage1 at stride 0\.0001 would be a 320,000 x 320,000 map"):
        vitkit.dense_features(m, x, layers=1, strides=(1e-4,))
    from vitkit.models.dense import DenseBackbone

    with pytest.raises(UsageError, match=r"strides: stage1 at stride 0\.0001"):
        DenseBackbone(m, layers=1, strides=(1e-4,))(x)
    assert vitkit.dense_features(m, x, layers=1, strides=(8,))["stage1"].shape == (1, 192, 4, 4)


# ---- 2. Ctrl-C in `vitkit train` loses no work ----------------------------------------------------------------------

RUN_ARGS = ["fashion-mnist", "data.dataset=digits", "model.name=vit_ti16", "data.batch_size=16", "data.eval_batch_size=500",
            'model.overrides={"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, '
            '"mlp_dim": 64}', "aug.hflip=false", "aug.pad=0", "run.tta=none", "schedule.epochs=3", "run.ckpt_every=1000",
            "run.progress=false", "run.log_every=1", "run.threads=1", "run.precision=fp32", "run.compile=off"]


class _Run:
    """`vitkit train` in its own process group (as a terminal's job: Ctrl-C reaches every process of it), its stderr
    read as it comes."""

    def __init__(self, out: Path, *args: str, sigint_ignored: bool = False, sighup_ignored: bool = False) -> None:
        import threading

        env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "OMP_NUM_THREADS": "1", "VITKIT_GEMM": "mkl"}
        self.out = out
        # each disposition set either way: a suite started under nohup (SIGHUP ignored) or with Ctrl-C ignored would
        # hand its own to the child, and a test of the default would test the inherited one instead
        wanted = ((signal.SIGINT, sigint_ignored), (signal.SIGHUP, sighup_ignored))
        ignore = lambda: [signal.signal(s, signal.SIG_IGN if on else signal.SIG_DFL) for s, on in wanted]  # noqa: E731
        self.proc = subprocess.Popen([sys.executable, "-m", "vitkit", "train", *args], cwd=PACKAGE.parent, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=ignore)
        self.err: list[str] = []
        self.stdout: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, into), daemon=True)
                         for f, into in ((self.proc.stderr, self.err), (self.proc.stdout, self.stdout))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(f, into: list[str]) -> None:
        for line in f:
            into.append(line)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait_until(self, done, what: str, limit_s: float = 300) -> None:
        """Until done() (a run that ends first, or a wait past limit_s, fails: that is a hang, not slowness)."""
        end = time.monotonic() + limit_s
        while not done():
            if self.proc.poll() is not None and not done():
                raise AssertionError(f"the run ended before {what}: {''.join(self.err)[-2000:]}")
            if time.monotonic() > end:
                self.proc.kill()
                raise AssertionError(f"no {what} within {limit_s} s: {''.join(self.err)[-2000:]}")
            time.sleep(0.01)

    def logged_step(self) -> int:
        f = self.out / "metrics.jsonl"
        lines = f.read_text().splitlines() if f.exists() else []
        return max([json.loads(x).get("step", 0) for x in lines if x.strip().endswith("}")] or [0])

    def finish(self, limit_s: float = 300) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"still running after {limit_s} s: {''.join(self.err)[-2000:]}") from None
        for t in self._readers:
            t.join(10)
        return self.proc.returncode, "".join(self.stdout), "".join(self.err)


def _image_folder(root: Path, per_class: int = 200) -> None:
    """An ImageFolder of 16 x 16 PNGs, 2 classes: 400 training images (an epoch of 25 steps of 16) and a few to test."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 4)):
        for c in range(2):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(d / f"{i}.png")


@pytest.mark.parametrize("data", ["digits", "folder"], ids=["in-memory", "folder-with-a-worker"])
def test_ctrl_c_in_train_saves_the_step_in_hand_and_the_printed_command_resumes_it(tmp_path, data):
    """Ctrl-C exited 130 with no checkpoint (up to run.ckpt_every steps lost) and no word on resuming: now the step in
    hand is finished and saved, the command that resumes it printed, exit 130; that command continues from it. With
    a folder decoded by a DataLoader worker, which the terminal's Ctrl-C reaches too (was: the worker ended on it)."""
    import shlex

    from vitkit.training import checkpoint

    out, extra, epoch = tmp_path / "run", [], 94  # 1500 digits / 16: an epoch is 94 steps
    if data == "folder":
        _image_folder(tmp_path / "imgs")
        extra, epoch = [f"data.dataset={tmp_path / 'imgs'}", "data.num_workers=1"], 25
    run = _Run(out, *RUN_ARGS, f"run.out_dir={out}", *extra)
    run.wait_until(lambda: run.logged_step() >= 5, "step 5")
    run.ctrl_c()
    code, stdout, err = run.finish()
    assert code == 130, err[-2000:]
    saved = checkpoint.latest(out)
    assert saved is not None, err[-2000:]
    step = checkpoint.read_meta(saved)["step"]
    assert 5 <= step < epoch, step  # before the epoch's end; run.ckpt_every=1000: saved by the Ctrl-C
    assert json.loads(stdout)["step"] == step and run.logged_step() == step  # the step in hand, logged and saved
    assert f"stopped by Ctrl-C (SIGINT) at step {step}: the run is saved in {saved}" in err
    assert err.count("vitkit: Ctrl-C: stopping after this step") == 1, err[-2000:]  # said once: not by a worker too
    hint = [line for line in err.splitlines() if line.startswith("vitkit: resume with: vitkit train ")]
    assert len(hint) == 1, err[-2000:]
    again = _Run(out, *shlex.split(hint[0].split("vitkit train ", 1)[1]), "--max-steps", str(step + 2))
    code, stdout, err = again.finish()
    assert code == 0, err[-2000:]
    assert json.loads(stdout)["step"] == step + 2
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in records if "loss" in r and "split" not in r and "acc1" not in r]
    assert steps == list(range(1, step + 3)), steps  # continued from the saved step: each step logged once


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    out = tmp_path / "run"
    run = _Run(out, *RUN_ARGS, f"run.out_dir={out}")
    run.wait_until(lambda: run.logged_step() >= 3, "step 3")
    run.ctrl_c()
    run.wait_until(lambda: any("Ctrl-C again aborts at once" in line for line in run.err), "word of the first Ctrl-C")
    run.ctrl_c()
    code, _, err = run.finish(limit_s=120)
    # 130, or ended by SIGINT itself (a shell's $? is 130 for both): CPython may end the process by re-sending itself
    # SIGINT at exit when the KeyboardInterrupt was raised inside some of torch's native calls, though vitkit caught it
    assert code in (130, -signal.SIGINT), err[-2000:]
    assert "vitkit: interrupted" in err or "stopped by Ctrl-C (SIGINT)" in err, err[-2000:]  # aborted, or done first


@pytest.mark.parametrize("ignored", [False, True], ids=["plain", "started-with-sigint-ignored"])
def test_ctrl_c_in_a_two_process_run_stops_every_rank_at_one_saved_step(tmp_path, ignored):
    """`vitkit train --nproc 2` (gloo): the terminal's Ctrl-C reaches vitkit and torchrun, which passes it to both
    ranks; they agree on the step to stop at (as for SIGTERM), save it once, and vitkit waits for them: exit 130 (was:
    vitkit killed torchrun a quarter second later and the ranks ended without saving). Also where vitkit was started
    with SIGINT ignored, as a pytest-xdist worker can start it: the ranks and torchrun handle it themselves, and vitkit
    missed it and ended with torchrun's 1 (this test failed in full suites)."""
    from vitkit.training import checkpoint

    out = tmp_path / "run"
    run = _Run(out, "--nproc", "2", *RUN_ARGS, f"run.out_dir={out}", sigint_ignored=ignored)
    run.wait_until(lambda: run.logged_step() >= 3, "step 3")
    run.ctrl_c()
    code, stdout, err = run.finish()
    assert code == 130, err[-3000:]
    saved = checkpoint.latest(out)
    assert saved is not None and [p.name for p in (out / "checkpoints").iterdir()] == [saved.name], err[-3000:]
    meta = checkpoint.read_meta(saved)
    assert meta["world_size"] == 2 and 3 <= meta["step"] < 94 and json.loads(stdout)["step"] == meta["step"]
    assert "vitkit: resume with: vitkit train --nproc 2 fashion-mnist " in err


def _processes_naming(text: str) -> list[str]:
    """The command lines of this machine's processes that hold `text` (Linux's /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not a process
            continue
        if text in cmd:
            found.append(cmd)
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux's /proc to list the ranks")
@pytest.mark.parametrize("sig,to", [("SIGTERM", "vitkit"), ("SIGTERM", "group"), ("SIGHUP", "vitkit"),
                                    ("SIGKILL", "vitkit"), ("SIGQUIT", "group"), ("SIGTERM", "vitkit, SIGUSR1 named")])
def test_a_job_runners_sigterm_in_a_two_process_run_stops_every_rank_at_one_saved_step(tmp_path, monkeypatch, sig, to):
    """`vitkit train --nproc 2`: a SIGTERM (a job runner, `kill`, a container stopping) or a SIGHUP (a closed terminal)
    sent to vitkit's own process ended it at once, exit -15, and left torchrun and both ranks training on to the end
    with no one waiting for them; sent to its process group, torchrun heard it too and the ranks saved, but vitkit
    was already gone (-15). Now vitkit passes it to torchrun once (torchrun runs in its own session, so a group's
    signal is not a second one), the ranks stop at one step and save it, vitkit waits: 143 (129 for SIGHUP), one
    checkpoint, the resume command printed, and no process of the run left behind. If vitkit itself is killed
    (SIGKILL), torchrun hears SIGTERM from Linux (PR_SET_PDEATHSIG) and the ranks save as for a SIGTERM (before:
    both ranks trained on to the end); a terminal's Ctrl-\\ (SIGQUIT) reaches torchrun once, which ends the ranks at
    once, and vitkit waits for it (131; a review found torchrun and the ranks left training on, out of reach). A
    cluster's own signal for torchrun (`PET_SIGNALS_TO_HANDLE=SIGUSR1`) keeps the SIGTERM handled too."""
    from vitkit.training import checkpoint

    if "SIGUSR1" in to:
        monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGUSR1")
    out = tmp_path / "run"
    run = _Run(out, "--nproc", "2", *RUN_ARGS, f"run.out_dir={out}")
    run.wait_until(lambda: run.logged_step() >= 3, "step 3")
    (os.killpg if to == "group" else os.kill)(run.proc.pid, getattr(signal, sig))
    code, stdout, err = run.finish()
    if sig == "SIGKILL":  # nothing waits for the ranks now: wait for them here (a hang bound)
        end = time.monotonic() + 120
        while _processes_naming(f"run.out_dir={out}") and time.monotonic() < end:
            time.sleep(0.1)
    assert _processes_naming(f"run.out_dir={out}") == [], err[-3000:]  # torchrun and the ranks ended
    assert code == {"SIGTERM": 143, "SIGHUP": 129, "SIGKILL": -9, "SIGQUIT": 131}[sig], err[-3000:]
    saved = checkpoint.latest(out)
    if sig == "SIGQUIT":  # ended at once: no step saved (run.ckpt_every=1000), the run's first files intact
        assert saved is None and "vitkit: SIGQUIT: torchrun ends the ranks at once" in err, err[-3000:]
        return
    assert saved is not None and [p.name for p in (out / "checkpoints").iterdir()] == [saved.name], err[-3000:]
    meta = checkpoint.read_meta(saved)
    assert meta["world_size"] == 2 and 3 <= meta["step"] < 94, meta
    if sig == "SIGKILL":
        return
    assert f"vitkit: {sig}: waiting for the ranks to save the step in hand" in err
    assert json.loads(stdout)["step"] == meta["step"] and f"stopped by {sig} at step {meta['step']}" in err
    assert "vitkit: resume with: vitkit train --nproc 2 fashion-mnist " in err


_STOP_AROUND_THE_START = """
import os, signal, subprocess, sys, threading, time
from pathlib import Path
from vitkit.training import launch
sig, when, ready = getattr(signal, sys.argv[1]), sys.argv[2], Path(sys.argv[3])
real_env, real_popen = launch.torchrun_env, subprocess.Popen
def env():  # called just before torchrun is started
    if when == "before":
        os.kill(os.getpid(), sig)
        time.sleep(0.2)
    return real_env()
def popen(*a, **k):  # torchrun forked and started, Popen not returned yet: the window a review found
    child = real_popen(*a, **k)
    print("started", child.pid, flush=True)
    if when == "while":
        os.kill(os.getpid(), sig)
        time.sleep(0.2)
    return child
launch.torchrun_env, launch.subprocess.Popen = env, popen
before, t = {s: signal.getsignal(s) for s in launch.STOP_EXIT}, time.monotonic()
child = "import time; time.sleep(30)"
if when in ("sigterm-then-ctrl-c", "late"):
    # a torchrun that ignores SIGTERM and Ctrl-C, with two ranks in sessions of their own that do too: it sleeps 30 s,
    # or ends whole after 4 s with no ranks; it writes their pids once it ignores the signals
    kids, nap = (2, 30) if when != "late" else (0, 4)
    child = (
        "import signal, subprocess, sys, time\\n"
        "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)]\\n"
        "rank = 'import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)]; time.sleep(60)'\\n"
        f"ranks = [subprocess.Popen([sys.executable, '-c', rank], start_new_session=True) for _ in range({kids})]\\n"
        f"open({str(ready)!r}, 'w').write(' '.join(str(r.pid) for r in ranks) + '.')\\n"
        f"time.sleep({nap})\\n")
    def stops():
        end = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().endswith(".")) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        if when != "late":
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=stops, daemon=True).start()
try:
    code = launch.run_ranks([sys.executable, "-c", child])
    print("returned", code, flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
finally:
    def running(pid):  # a SIGKILL lands when the process next runs: on a loaded machine, a moment later
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    alive, end = [], time.monotonic() + 10
    for pid in (ready.read_text().rstrip(".").split() if ready.exists() else []):
        while running(pid) and time.monotonic() < end:
            time.sleep(0.05)
        if running(pid):
            alive.append(pid)
            os.kill(int(pid), signal.SIGKILL)
    print("ranks left", len(alive), flush=True)
    print("restored", before == {s: signal.getsignal(s) for s in launch.STOP_EXIT}, flush=True)
    print(f"seconds {time.monotonic() - t:.0f}", flush=True)
"""


@pytest.mark.parametrize("sig,when", [("SIGINT", "before"), ("SIGTERM", "before"), ("SIGINT", "while"),
                                      ("SIGTERM", "while"), ("SIGTERM", "sigterm-then-ctrl-c"), ("SIGTERM", "late")])
def test_a_stop_around_torchruns_start_stops_it_or_starts_nothing(tmp_path, sig, when):
    """`vitkit train --nproc`'s wait (`run_ranks`, in a child process: before the change a SIGTERM there ended it).
    A stop before torchrun is started ends vitkit at once (130 as a KeyboardInterrupt, 143), nothing started; one
    that comes after torchrun was forked but before Popen returned (a review found it) is passed on to it once it
    has: torchrun (here a 30-second sleep in its own session) ends at once, not orphaned, and vitkit returns the
    signal's code. A Ctrl-C after a SIGTERM aborts at once (it was ignored), killing torchrun and its ranks, which
    run in sessions of their own (they were left running: reviews found both). A SIGTERM the run outlives whole
    (torchrun exits 0) returns 0. The handlers are put back either way."""
    done = subprocess.run([sys.executable, "-c", _STOP_AROUND_THE_START, sig, when, str(tmp_path / "ready")],
                          cwd=PACKAGE.parent, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}, timeout=120)
    lines, why = done.stdout.splitlines(), (done.stdout, done.stderr[-2000:])
    if when == "before":
        assert not any(line.startswith(("started", "returned")) for line in lines), why
        if sig == "SIGINT":
            assert done.returncode == 0 and "KeyboardInterrupt" in lines, why
        else:
            assert done.returncode == 143, why
    elif when == "sigterm-then-ctrl-c":
        assert lines[0].startswith("started") and lines[1] == "KeyboardInterrupt", why
    else:
        expected = 0 if when == "late" else launch_exit(sig)
        assert lines[0].startswith("started") and lines[1] == f"returned {expected}", why
    assert "ranks left 0" in lines, why
    # the handlers put back; the 30-second child ended with the signal, not waited out (a hang bound, not a speed)
    assert "restored True" in lines and int(lines[-1].split()[1]) < 20, why


def test_torchrun_handles_what_vitkit_passes_on_beside_the_users_own(monkeypatch):
    """torchrun (torch >= 2.9) takes the signals it handles from PET_SIGNALS_TO_HANDLE (its --signals-to-handle) and
    writes them over TORCHELASTIC_SIGNALS_TO_HANDLE: a user's SIGUSR1 there alone would leave a passed-on SIGTERM
    killing torchrun outright, the ranks orphaned (a review found vitkit set only the second). Both now name the
    user's signals and every one vitkit passes on, once each."""
    from vitkit.training import launch

    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGUSR1, SIGTERM")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2")
    env = launch.torchrun_env()
    for var in launch.SIGNAL_VARS:
        assert env[var].split(",") == ["SIGUSR1", "SIGTERM", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT"]


def launch_exit(sig: str) -> int:
    from vitkit.training import launch

    return launch.STOP_EXIT[getattr(signal, sig)]


def test_the_ranks_wait_off_the_main_thread():
    """`vitkit train --nproc`'s wait (`run_ranks`) called off the main thread (`vitkit.cli.main` in a thread), where
    no handler can be installed: it still runs and returns the child's code."""
    import threading

    from vitkit.training import launch

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("code", launch.run_ranks([sys.executable, "-c", "raise SystemExit(3)"])))
    t.start()
    t.join()
    assert out == {"code": 3}


@pytest.mark.parametrize("nproc", [1, 2])
def test_under_nohup_a_hangup_does_not_stop_the_run(tmp_path, nproc):
    """`nohup vitkit train ...` starts vitkit with SIGHUP ignored, to outlive the terminal: vitkit's own SIGHUP
    handler (the step in hand saved, exit 129) took its place, so a logout stopped the run (a review found it). A
    SIGHUP ignored from the start stays ignored, in one process and under `--nproc 2`: the run trains to its end."""
    from vitkit.training import checkpoint

    out = tmp_path / "run"
    run = _Run(out, *(["--nproc", "2"] if nproc > 1 else []), *RUN_ARGS, f"run.out_dir={out}", sighup_ignored=True)
    run.wait_until(lambda: run.logged_step() >= 3, "step 3")
    os.killpg(run.proc.pid, signal.SIGHUP)
    code, stdout, err = run.finish()
    result = json.loads(stdout)
    assert code == 0 and not result.get("interrupted") and (out / "final.safetensors").exists(), err[-3000:]
    assert result["step"] == checkpoint.read_meta(checkpoint.latest(out))["step"] > 200  # 3 epochs: all of them


def test_a_closed_terminal_sighup_saves_the_step_in_hand_as_sigterm_does(tmp_path):
    """SIGHUP (the terminal or the ssh session closed) killed the run with nothing saved since the last checkpoint:
    it is handled as SIGTERM is, the step in hand saved (exit 129)."""
    from vitkit.training import checkpoint

    out = tmp_path / "run"
    run = _Run(out, *RUN_ARGS, f"run.out_dir={out}")
    run.wait_until(lambda: run.logged_step() >= 3, "step 3")
    os.killpg(run.proc.pid, signal.SIGHUP)
    code, stdout, err = run.finish()
    assert code == 129, err[-2000:]
    saved = checkpoint.latest(out)
    assert saved is not None and checkpoint.read_meta(saved)["step"] >= 3, err[-2000:]
