"""The doors vitkit opens to untrusted bytes, as fuzz targets, and the property each must keep.

Every target takes arbitrary bytes, feeds them through one door (a checkpoint format, a config, a shard set, a
request to the service) and must end in a result or a vitkit error (`VitkitError`: the CLI's one-line refusal) --
never another exception, a hang or a file written outside its scratch folder. `check(target, data)` runs one input
and raises `PropertyViolation` when the property fails; `fuzz/run.py` drives it under atheris (coverage-guided,
time and memory capped), and tests/test_hostile.py replays every input in tests/fuzz_regressions/.

Each target's seeds (`seeds(target)`) are small valid inputs made from the project's own fixtures and models.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
REGRESSIONS = ROOT / "tests" / "fuzz_regressions"


class PropertyViolation(AssertionError):
    """An input that ended in something other than a result or a vitkit error."""


def _tiny_model(**kw):
    import torch

    import vitkit

    torch.manual_seed(0)
    cfg = dict(img_size=8, patch_size=4, num_classes=3, depth=1, embed_dim=8, num_heads=2, mlp_dim=16)
    cfg.update(kw)
    return vitkit.create_model("vit_ti16", **cfg).eval()


# ---- the doors ------------------------------------------------------------------------------------------------

def _load_file(suffix: str) -> Callable[[bytes, Path], None]:
    def run(data: bytes, tmp: Path) -> None:
        import vitkit

        path = tmp / f"model{suffix}"
        path.write_bytes(data)
        vitkit.load(path)
    return run


def _load_folder(weights: Path) -> Callable[[bytes, Path], None]:
    """A hub folder: the fuzzed bytes are its config.json beside real weights."""
    def run(data: bytes, tmp: Path) -> None:
        import vitkit

        folder = tmp / "folder"
        folder.mkdir()
        (folder / "config.json").write_bytes(data)
        os.symlink(weights, folder / "model.safetensors")
        vitkit.load(folder)
    return run


_RUN_STEP: Path | None = None


def _run_step() -> Path:
    """A real step folder of a tiny run (written once per process)."""
    global _RUN_STEP
    if _RUN_STEP is None:
        import torch

        from vitkit.training.distributed import Dist
        from vitkit.training import checkpoint

        m = _tiny_model()
        out = Path(tempfile.mkdtemp(prefix="vitkit-fuzz-run-"))
        _RUN_STEP = checkpoint.save(out, 1, m, torch.optim.AdamW(m.parameters()), None,
                                    {"model_config": m.config.to_dict(), "config": {}}, Dist())
    return _RUN_STEP


def _run_checkpoint(data: bytes, tmp: Path) -> None:
    """A training run's step folder whose DCP index (.metadata, a pickle) is the input, beside real shards."""
    import shutil

    import vitkit

    step = tmp / "step-00000001"
    shutil.copytree(_run_step(), step)
    (step / ".metadata").write_bytes(data)
    vitkit.load(step)


def _overrides(data: bytes, tmp: Path) -> None:
    """key=value lines, as `vitkit train` takes them, applied to the default preset, and the model they describe."""
    from vitkit.models.registry import build_config, build_model
    from vitkit.training import apply_overrides, get_preset

    text = data.decode("utf-8", "replace")
    pairs = dict(line.split("=", 1) for line in text.splitlines()[:32] if "=" in line)
    cfg = apply_overrides(get_preset("fashion-mnist", smoke=True), pairs)
    build_model(build_config(cfg.model.name, **cfg.model.overrides))


def _config_file(data: bytes, tmp: Path) -> None:
    """A YAML config file, as `vitkit train --config` reads it."""
    from vitkit.models.registry import build_config, build_model
    from vitkit.training import TrainConfig, load_config_file

    path = tmp / "config.yaml"
    path.write_bytes(data)
    cfg = TrainConfig.from_dict(load_config_file(path))
    build_model(build_config(cfg.model.name, **cfg.model.overrides))


def _shards(data: bytes, tmp: Path) -> None:
    """A shard set whose index.json, .idx.npy or tar is replaced by the input (its first byte says which), every
    sample then read as the trainer's DataLoader workers read them."""
    from vitkit.data.shards import ShardDataset

    root = _shard_set(tmp / "shards")
    which = (data[:1] or b"\0")[0] % 3
    target = root / ("index.json", "shard-000000.idx.npy", "shard-000000.tar")[which]
    target.write_bytes(data[1:])
    ds = ShardDataset.open(str(root), img_size=(8, 8))
    for i in range(min(len(ds), 16)):
        ds[i]


def _shard_set(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    from vitkit.data.pack import write_split

    def samples():
        for i in range(3):
            buf = io.BytesIO()
            Image.fromarray(np.full((6, 6, 3), 70 * i, np.uint8)).save(buf, format="PNG")
            yield buf.getvalue(), "png", i

    write_split(samples(), root, ["a", "b", "c"], 3, shard_size=8, name="fuzz")
    return root


_CLIENT = None


def _service(endpoint: str) -> Callable[[bytes, Path], None]:
    """A request to the service: the first byte picks the content type, the rest is the body. Any answer under 500
    keeps the property; a 5xx breaks it."""
    def run(data: bytes, tmp: Path) -> None:
        global _CLIENT
        if _CLIENT is None:
            from fastapi.testclient import TestClient

            from vitkit.serve import Limits, TorchPredictor, create_app

            _CLIENT = TestClient(create_app(TorchPredictor(_tiny_model(img_size=16), precision="fp32"),
                                            Limits(max_upload_mb=1, max_pixels=1_000_000, timeout_s=10), name="fuzz"))
            _CLIENT.__enter__()  # the app's lifespan: the micro-batcher runs
        ctypes = ("image/png", "application/json", "multipart/form-data; boundary=xyz", "application/octet-stream",
                  "text/plain", "multipart/form-data")
        ctype = ctypes[(data[:1] or b"\0")[0] % len(ctypes)]
        r = _CLIENT.post(endpoint, content=data[1:], headers={"content-type": ctype})
        if r.status_code >= 500:
            raise PropertyViolation(f"POST {endpoint} ({ctype}) answered {r.status_code}: {r.text[:300]}")
        json.loads(r.text)  # every answer, error or not, is JSON
    return run


def _image(data: bytes, tmp: Path) -> None:
    """Image decoding, as predict, eval and the service decode files."""
    from vitkit.data.image import load_image

    load_image(io.BytesIO(data), 3, max_pixels=4_000_000)


_PREDICT_NAMES = ["a.png", "b,c.png", "d\u00e9.png"]  # the inputs a fuzzed resume file is checked against
_PREDICT_RUN = "model=00112233aabbccdd preprocess=01234567 top_k=2 tta=none precision=fp32 backend=torch device=cpu " \
               "max_patches=none"


def _predict_inputs(data: bytes, tmp: Path) -> None:
    """What `vitkit predict` reads from outside besides the model, the first byte saying which: 0-1 an image,
    decoded as predict decodes it (`load_image` within a pixel limit, then the checkpoint's eval resize and crop,
    RGB or grey: 16-bit, float and odd modes, absurd aspect ratios); 2 a CSV list of image paths (`gather_inputs`);
    3-4 an output file to resume (`read_done`, jsonl or csv), checked against three inputs and a run."""
    from vitkit.data.image import load_image, resize_crop
    from vitkit.inference.predict import gather_inputs, read_done

    which, body = (data[:1] or b"\0")[0] % 5, data[1:]
    if which <= 1:
        img = load_image(io.BytesIO(body), 3 if which == 0 else 1, max_pixels=4_000_000)
        resize_crop(img, (16, 12), 0.875, "bicubic" if which == 0 else "bilinear")
    elif which == 2:
        (tmp / "list.csv").write_bytes(body)
        gather_inputs([tmp / "list.csv"])
    else:
        out = tmp / ("out.jsonl" if which == 3 else "out.csv")
        out.write_bytes(body)
        read_done(out, out.suffix[1:], _PREDICT_NAMES, 2, _PREDICT_RUN)
        if out.read_bytes() != body:
            raise PropertyViolation("read_done changed the file it read")


def _package(data: bytes, tmp: Path) -> None:
    """A compiled package (`.pt2`) through the one door every package takes (`aoti.open_package`: the private copy,
    the zip's members, the trust check) with the opt-in given, then its metadata's checks and its config: never
    loaded (a fuzzed shared library is not run here, and vitkit runs none it did not vouch for)."""
    from vitkit.checkpoints.api import config_from_dict
    from vitkit.machine import aoti
    from vitkit.safety import parse_json

    (tmp / "pkg.pt2").write_bytes(data)
    with contextlib.redirect_stderr(io.StringIO()):  # the opt-in's warning, once per input
        package = aoti.open_package(tmp / "pkg.pt2", trust=True)
    if not package.libraries or not package.file.is_file():
        raise PropertyViolation("open_package accepted a package with no library or no private copy")
    aoti.check_runnable(package.meta, tmp / "pkg.pt2")
    if "vitkit_config" in package.meta:
        config_from_dict(parse_json(package.meta["vitkit_config"], "vitkit_config", aoti.CheckpointError))


def _package_seeds() -> dict[str, bytes]:
    """A package laid out as AOTInductor lays out vitkit's (records, generated C++, metadata, a stand-in library),
    and its zip tricks: a pickle member, a link, a `..` name."""
    import zipfile

    from vitkit.machine import aoti

    meta = {"AOTI_DEVICE_KEY": "cpu", "vitkit_torch": __import__("torch").__version__, "vitkit_isa": aoti.vec_isa(),
            "vitkit_config": json.dumps({"arch": "vit", "img_size": [32, 32], "patch_size": [8, 8], "embed_dim": 16,
                                         "depth": 1, "num_heads": 2, "mlp_dim": 32, "num_classes": 3})}
    base = [("m/archive_format", b"pt2"), ("m/archive_version", b"0"), ("m/.data/version", b"1\n"), ("m/byteorder", b"little"),
            ("m/data/aotinductor/model/abc.wrapper.cpp", b"// generated\n"),
            ("m/data/aotinductor/model/abc.wrapper_metadata.json", json.dumps(meta).encode()),
            ("m/data/aotinductor/model/abc.wrapper.so", b"\x7fELF" + bytes(56))]
    link = zipfile.ZipInfo("m/data/aotinductor/model/link.so")
    link.external_attr = 0o120777 << 16

    def zipped(members) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for name, body in members:
                z.writestr(name, body)
        return buf.getvalue()

    return {"package": zipped(base),
            "pickle": zipped(base + [("m/data/sample_inputs/model.pt", b"\x80\x04K\x01.")]),
            "link": zipped(base + [(link, b"/etc/passwd")]),
            "dotdot": zipped(base + [("m/../x.so", b"\x7fELF")])}


TARGETS: dict[str, Callable[[bytes, Path], None]] = {
    "npz": _load_file(".npz"),
    "safetensors": _load_file(".safetensors"),
    "pth": _load_file(".pth"),
    "hf_config": _load_folder(FIXTURES / "modern" / "hf_dinov2" / "model.safetensors"),
    "timm_config": _load_folder(FIXTURES / "modern" / "timm_dinov2" / "model.safetensors"),
    "run_checkpoint": _run_checkpoint,
    "overrides": _overrides,
    "config_yaml": _config_file,
    "shards": _shards,
    "predict": _service("/predict"),
    "explain": _service("/explain"),
    "image": _image,
    "predict_inputs": _predict_inputs,
    "package": _package,
}


def check(target: str, data: bytes) -> None:
    """Run one input through `target`: a result or a vitkit error passes; anything else raises PropertyViolation
    (with the original exception as its cause), as does a file left outside the scratch folder."""
    from vitkit.errors import VitkitError

    with tempfile.TemporaryDirectory(prefix="vitkit-fuzz-") as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                TARGETS[target](data, scratch)
        except VitkitError:
            pass
        except PropertyViolation:
            raise
        except Exception as e:
            raise PropertyViolation(f"{target}: {type(e).__name__}: {str(e)[:500]}") from e
        finally:
            os.chdir(cwd)
        stray = [p.name for p in Path(tmp).iterdir() if p.name != "scratch"]
        if stray:
            raise PropertyViolation(f"{target}: wrote {stray} into its working folder")


# ---- seeds -------------------------------------------------------------------------------------------------

def seeds(target: str) -> dict[str, bytes]:
    """Small valid inputs for `target`, from the project's fixtures and a tiny model in every format."""
    import numpy as np

    import vitkit

    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if target in ("npz", "safetensors", "pth"):
            m = _tiny_model()
            if target == "npz":
                out["official"] = vitkit.export(_tiny_model(act="gelu_tanh"), tmp / "m.npz", "npz").read_bytes()
            elif target == "safetensors":
                out["vitkit"] = vitkit.save(m, tmp / "m.safetensors").read_bytes()
                out["timm"] = vitkit.export(m, tmp / "t.safetensors", "timm").read_bytes()
            else:
                out["timm"] = vitkit.export(m, tmp / "t.pth", "timm").read_bytes()
        elif target in ("hf_config", "timm_config"):
            prefix = "hf_" if target == "hf_config" else "timm_"
            for f in sorted(FIXTURES.glob(f"**/{prefix}*/config.json")):
                out[f.parent.name] = f.read_bytes()
        elif target == "run_checkpoint":
            out["metadata"] = (_run_step() / ".metadata").read_bytes()
        elif target == "overrides":
            out["model"] = b"model.name=vit_ti16\nmodel.overrides.depth=2\nmodel.overrides.img_size=32\n"
            out["optim"] = b"optim.lr=2e-3\ndata.batch_size=64\nschedule.epochs=1.5\nrun.ema=0.999\n"
            out["swin"] = b"model.name=swin_t\nmodel.overrides={depths: [1, 1], num_heads: [2, 4]}\n"
        elif target == "config_yaml":
            out["train"] = (b"preset: fashion-mnist\ndata: {dataset: digits, batch_size: 32}\n"
                            b"model: {name: vit_ti16, overrides: {depth: 2, img_size: 8, patch_size: 4}}\n"
                            b"optim: {lr: 0.001, betas: [0.9, 0.99]}\n")
        elif target == "shards":
            root = _shard_set(tmp / "s")
            out["index"] = b"\0" + (root / "index.json").read_bytes()
            out["idx"] = b"\1" + (root / "shard-000000.idx.npy").read_bytes()
            out["tar"] = b"\2" + (root / "shard-000000.tar").read_bytes()
        elif target in ("predict", "explain", "image"):
            from PIL import Image

            buf = io.BytesIO()
            Image.fromarray(np.arange(16 * 20 * 3, dtype=np.uint8).reshape(16, 20, 3)).save(buf, format="PNG")
            png = buf.getvalue()
            if target == "image":
                out["png"] = png
            else:
                import base64

                out["raw"] = b"\0" + png
                out["json"] = b"\1" + json.dumps({"image": base64.b64encode(png).decode(), "top_k": 2}).encode()
                out["multipart"] = (b"\2--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n"
                                    b"Content-Type: image/png\r\n\r\n" + png + b"\r\n--xyz--\r\n")
        elif target == "predict_inputs":
            out.update(_predict_seeds())
        elif target == "package":
            out.update(_package_seeds())
    return out


def _predict_seeds() -> dict[str, bytes]:
    """A 16-bit PNG, a float TIFF, a tall PNG, an RGB PNG, a CSV list, and this command's own jsonl and csv
    output, whole and cut short."""
    import numpy as np
    from PIL import Image

    from vitkit.inference.predict import CSV_HEADER, format_records

    def encoded(img: Image.Image, fmt: str) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format=fmt)
        return buf.getvalue()

    g = np.random.default_rng(0)
    out = {"png16": b"\0" + encoded(Image.fromarray(g.integers(0, 65536, (12, 9), dtype=np.uint16)), "PNG"),
           "float_tiff": b"\1" + encoded(Image.fromarray(g.random((7, 11), dtype=np.float32)), "TIFF"),
           "tall": b"\0" + encoded(Image.new("L", (1, 3000), 77), "PNG"),
           "rgb": b"\0" + encoded(Image.fromarray(g.integers(0, 255, (10, 14, 3), dtype=np.uint8)), "PNG"),
           "csv_list": b"\2path,label\na.png,cat\n\"b,c.png\",dog\nsub/x.jpg\n"}
    recs = [{"image": _PREDICT_NAMES[0], "top": [{"index": 1, "label": "b", "probability": 0.75},
                                                  {"index": 0, "label": "a", "probability": 0.25}]},
            {"image": _PREDICT_NAMES[1], "error": "cannot decode image b,c.png: truncated"}]
    jsonl = format_records("jsonl", recs, True, _PREDICT_RUN).encode()
    csv_text = (",".join(CSV_HEADER) + "\n" + format_records("csv", recs, True, _PREDICT_RUN)).encode()
    out.update({"resume_jsonl": b"\3" + jsonl, "resume_jsonl_cut": b"\3" + jsonl[:-30],
                "resume_csv": b"\4" + csv_text, "resume_csv_cut": b"\4" + csv_text[:-20]})
    return out


def regressions(target: str | None = None) -> list[tuple[str, Path]]:
    """The inputs a campaign once found breaking the property, kept as regression tests: (target, file)."""
    return [(d.name, f) for d in sorted(REGRESSIONS.iterdir()) if d.is_dir() and (target is None or d.name == target)
            for f in sorted(d.iterdir()) if f.is_file()] if REGRESSIONS.exists() else []
