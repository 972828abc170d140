"""Issue 52, the writing side of the trust boundary: an output is a regular file or nothing (a FIFO, a device, a
link there is refused by name and left as it was), a full disk is one line that loses nothing, `predict --resume`
carries on only what this command wrote with these settings, and an image or a CSV list from outside is decoded
within its size (16-bit and float images as they look, an absurd aspect ratio without an absurd allocation), each
failure that image's record or one line.

Every test here fails on the code before the fix (issue 52's cases); none mocks what it tests: the nodes are real
FIFOs and devices, the full disk is the kernel's file-size limit, the memory the address-space limit."""
import contextlib
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.cli import main
from vitkit.errors import UsageError

CLASSES = ["cat", "dog", "bird", "fish"]
CPU = ["--precision", "fp32", "--device", "cpu", "--no-progress"]
VITKIT_ROOT = Path(vitkit.__file__).resolve().parents[1]  # the vitkit under test, for the child processes


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                            num_classes=4, class_names=CLASSES)
    torch.nn.init.normal_(m.head.weight, std=0.5)
    return m


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture and preprocessing, other weights."""
    root = tmp_path_factory.mktemp("ckpts")
    return vitkit.save(_model(0), root / "a.safetensors"), vitkit.save(_model(1), root / "b.safetensors")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("imgs")
    out = []
    for i in range(4):
        out.append(root / f"{i}.png")
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(out[-1])
    return out


@pytest.fixture(autouse=True)
def _one_gemm(monkeypatch):
    """No GEMM measurement in the middle of these runs (not what they test)."""
    from vitkit.machine import gemm

    monkeypatch.setattr(gemm, "FORCE", "onednn-packed")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _null_device(path: Path) -> Path:
    """A character device node like /dev/null (1, 3), made where a test can watch what happens to it."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


def _one_line_error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("vitkit: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _in_time(fn, fifo: Path | None = None, seconds: float = 60.0):
    """fn() in a thread; a run still blocked after `seconds` (opening a FIFO waits for its other end) fails the
    test, after the FIFO's other end is opened so that the thread can end."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo is not None:
            with contextlib.suppress(OSError):
                fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader: the blocked writer goes on
                t.join(30)
                os.close(fd)
        pytest.fail(f"still blocked after {seconds} s (on the FIFO)")
    return result.get("value")


# ---- 1. outputs: a regular file or nothing ----------------------------------------------------------------------

@pytest.mark.parametrize("node", ["fifo", "char device"])
def test_features_and_convert_refuse_a_fifo_or_a_device_as_the_output_and_leave_it(ckpts, images, tmp_path, capsys,
                                                                                   node):
    out = _fifo(tmp_path / "out") if node == "fifo" else _null_device(tmp_path / "out")
    kind = stat.S_ISFIFO if node == "fifo" else stat.S_ISCHR
    for argv in (["features", str(images[0]), "--checkpoint", str(ckpts[0]), "--out", str(out), "--device", "cpu",
                  "--precision", "fp32"], ["convert", str(ckpts[0]), str(out)],
                 ["convert", str(ckpts[0]), str(out), "--to", "npz"]):
        assert _in_time(lambda: main(argv), out) == 2, argv
        assert kind(os.lstat(out).st_mode), f"{argv[0]} replaced the {node} with a regular file"
        line = _one_line_error(capsys.readouterr().err)
        assert str(out) in line and "not a regular file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary file left beside it


def test_a_symlink_as_the_output_is_refused_the_link_and_its_target_kept(ckpts, images, tmp_path, capsys):
    target = tmp_path / "target.safetensors"
    target.write_bytes(b"the user's own file")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert main(["features", str(images[0]), "--checkpoint", str(ckpts[0]), "--out", str(link), "--device", "cpu",
                 "--precision", "fp32"]) == 2
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() == b"the user's own file"
    assert "symbolic link" in _one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("resume", [False, True])
def test_predict_out_fifo_is_refused_not_waited_on(ckpts, images, tmp_path, capsys, resume):
    fifo = _fifo(tmp_path / "records.jsonl")
    argv = ["predict", str(images[0]), "--checkpoint", str(ckpts[0]), "--out", str(fifo), *CPU] + (
        ["--resume"] if resume else [])
    assert _in_time(lambda: main(argv), fifo, seconds=30) == 2
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert "FIFO" in _one_line_error(capsys.readouterr().err)


def test_a_write_the_system_refuses_keeps_the_old_file_and_is_an_os_error_too(tmp_path):
    """What a full disk does to a write (ENOSPC from the write itself), through the one writer: a one-line
    UsageError that is also an OSError (a cache write that fails is shrugged off, as before), the old file intact,
    no temporary file left."""
    import errno

    from vitkit.cache import atomic_write

    old = tmp_path / "f.bin"
    old.write_bytes(b"old")

    def fill(p: Path) -> None:
        p.write_bytes(b"new, half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UsageError) as e:
        atomic_write(old, fill)
    assert isinstance(e.value, OSError) and "No space left on device" in str(e.value) and str(old) in str(e.value)
    assert old.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def _limited(argv: list[str], fsize: int, cwd: Path) -> subprocess.CompletedProcess:
    """`vitkit ARGV` in a child whose files may not grow beyond `fsize` bytes (RLIMIT_FSIZE, SIGXFSZ ignored: a
    write past it fails with EFBIG, as the kernel fails a write to a full disk)."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "PYTHONPATH": str(VITKIT_ROOT), "VITKIT_GEMM": "onednn-packed", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vitkit.cli", *argv], preexec_fn=limit, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_features_on_a_full_disk_is_one_line_and_the_old_file_intact(ckpts, images, tmp_path):
    out = tmp_path / "features.safetensors"
    out.write_bytes(b"the features of yesterday")
    r = _limited(["features", *map(str, images), "--checkpoint", str(ckpts[0]), "--out", str(out), "--device", "cpu",
                  "--precision", "fp32"], 200, tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _one_line_error(r.stderr)
    assert str(out) in line and "File too large" in line
    assert out.read_bytes() == b"the features of yesterday"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.safetensors"]


def test_predict_on_a_full_disk_is_one_line_and_resume_finishes_the_file(ckpts, images, tmp_path, capsys):
    out = tmp_path / "records.jsonl"
    args = ["predict", *map(str, images), "--checkpoint", str(ckpts[0]), "--batch-size", "1", "--num-workers", "0",
            *CPU]
    r = _limited([*args, "--out", str(out)], 700, tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _one_line_error(r.stderr)
    assert str(out) in line and "File too large" in line and "--resume" in line
    lines = out.read_bytes().split(b"\n")
    assert 1 <= len(lines) - 1 < len(images)  # whole records, then at most a part of the next one
    assert main([*args, "--out", str(out), "--resume"]) == 0  # no limit now: carries on, the cut line redone
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["image"] for r in recs] == list(map(str, images)) and all(len(r["top"]) == 3 for r in recs)


# ---- 2. predict --resume is honest ------------------------------------------------------------------------------

def test_resume_refuses_the_file_of_another_checkpoint_or_other_settings_untouched(ckpts, images, tmp_path, capsys):
    for suffix in (".jsonl", ".csv"):
        out = tmp_path / f"r{suffix}"
        base = ["predict", *map(str, images[:3]), "--out", str(out), "--batch-size", "1", *CPU]
        assert main([*base, "--checkpoint", str(ckpts[0])]) == 0
        first = out.read_bytes().split(b"\n")
        out.write_bytes(b"\n".join(first[:2]) + b"\n")  # stopped early (jsonl: two records; csv: the header, a row)
        kept = out.read_bytes()
        for extra, named in ((["--checkpoint", str(ckpts[1])], "another checkpoint"),
                             (["--checkpoint", str(ckpts[0]), "--tta", "flip"], "tta: none there, flip now"),
                             (["--checkpoint", str(ckpts[0]), "--top-k", "2"], "top_k: 3 there, 2 now")):
            capsys.readouterr()
            assert main([*base, "--resume", *extra]) == 2, (suffix, extra)
            line = _one_line_error(capsys.readouterr().err)
            assert named in line and str(out) in line, line
            assert out.read_bytes() == kept  # refused: not a byte changed
        assert main([*base, "--resume", "--checkpoint", str(ckpts[0])]) == 0  # its own run carries on


def test_resume_never_cuts_or_continues_a_file_it_did_not_write(ckpts, images, tmp_path, capsys):
    args = ["predict", *map(str, images[:2]), "--checkpoint", str(ckpts[0]), *CPU, "--resume"]
    records = [{"image": str(images[0]), "top": [{"index": i, "label": CLASSES[i], "probability": 0.25}
                                                  for i in range(3)]}]
    foreign = {
        "notes.jsonl": b"hello world",  # one line, no newline: not a record cut short, somebody's file
        "notes.csv": b"hello world",
        "half.jsonl": b'{"image": "other.png", "top": [{"ind',  # the start of a record of another input
        "old.jsonl": (json.dumps(records[0]) + "\n").encode(),  # an earlier vitkit's: which checkpoint made it?
        "old.csv": b"image,rank,index,label,probability,error\n",
    }
    for name, data in foreign.items():
        f = tmp_path / name
        f.write_bytes(data)
        capsys.readouterr()
        assert main([*args, "--out", str(f)]) == 2, name
        assert f.read_bytes() == data, name
        _one_line_error(capsys.readouterr().err)


# ---- 4. images: as they look, within their size ----------------------------------------------------------------

def _png16(path: Path, arr: np.ndarray) -> Path:
    Image.fromarray(arr.astype(np.uint16)).save(path)
    assert Image.open(path).mode in ("I;16", "I")  # what PIL gives a 16-bit greyscale PNG
    return path


def test_16_bit_and_float_images_decode_to_what_they_show_not_white(tmp_path):
    from vitkit.data.image import load_image

    rng = np.random.default_rng(0)
    a16 = rng.integers(0, 65536, (12, 10), dtype=np.uint16)
    ref = np.round(a16.astype(np.float64) * 255 / 65535).astype(np.uint8)  # 0..65535 onto 0..255
    got = np.asarray(load_image(_png16(tmp_path / "g16.png", a16), 3))
    assert got.shape == (12, 10, 3) and np.array_equal(got, np.repeat(ref[..., None], 3, -1))
    assert np.array_equal(np.asarray(load_image(tmp_path / "g16.png", 1)), ref)
    dark = np.full((8, 8), 1000, np.uint16)  # a dark 16-bit image: 4/255, not white
    assert np.asarray(load_image(_png16(tmp_path / "dark.png", dark), 1)).max() == 4
    Image.fromarray(a16.astype(">u2")).save(tmp_path / "g16b.tif")  # big-endian TIFF (I;16B)
    assert np.array_equal(np.asarray(load_image(tmp_path / "g16b.tif", 1)), ref)
    Image.fromarray(a16.astype(np.int32)).save(tmp_path / "i32.tif")  # mode I
    assert np.array_equal(np.asarray(load_image(tmp_path / "i32.tif", 1)), ref)
    f = rng.random((12, 10), dtype=np.float32)  # a float TIFF in [0, 1]
    Image.fromarray(f).save(tmp_path / "f.tif")
    assert np.array_equal(np.asarray(load_image(tmp_path / "f.tif", 1)), np.rint(f * 255).astype(np.uint8))
    assert np.array_equal(np.asarray(load_image(a16, 1)), ref)  # an array of 16-bit values, as a service gets one


def test_other_modes_decode_as_pil_shows_them(tmp_path):
    """LA, P with transparency, CMYK, 1, LAB: the colours they show (not white or black), and a mode PIL cannot make
    RGB of is a one-line ImageDecodeError (it was a ValueError from PIL)."""
    from vitkit.data.image import ImageDecodeError, load_image

    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 255, (9, 7, 3), dtype=np.uint8)
    cases = {"LA": Image.merge("LA", [Image.fromarray(rgb[..., 0]), Image.fromarray(rgb[..., 1])]),
             "CMYK": Image.fromarray(rgb).convert("CMYK"), "1": Image.fromarray(rgb[..., 0] > 127),
             "P": Image.fromarray(rgb).quantize(16), "LAB": Image.fromarray(rgb).convert("LAB")}
    cases["P"].info["transparency"] = 0
    for mode, img in cases.items():
        path = tmp_path / f"{mode}.{'jpg' if mode == 'CMYK' else 'tif' if mode == 'LAB' else 'png'}"
        img.save(path)
        with Image.open(path) as ref:
            want = np.asarray(ref.convert("RGBA" if mode == "P" else "RGB").convert("RGB"))
        got = np.asarray(load_image(path, 3))
        assert got.shape == (9, 7, 3) and np.abs(got.astype(int) - want).max() <= 1, mode
        assert 0 < got.mean() < 255, mode
    with pytest.raises(ImageDecodeError, match="La"):  # premultiplied LA: PIL has no conversion to RGB or L
        load_image(Image.new("La", (4, 4)), 3)


@contextlib.contextmanager
def _address_space(headroom: int):
    """This process may map at most `headroom` bytes more than it has now (RLIMIT_AS): an allocation beyond fails
    with MemoryError at once, as on a machine without them."""
    with open("/proc/self/status") as f:
        size = int(next(x for x in f if x.startswith("VmSize:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_an_absurd_aspect_ratio_is_decoded_within_its_size_and_predict_goes_on(ckpts, images, tmp_path, capsys):
    """A 1 x 8,000,000 PNG (10 KB): the eval resize to 16 px on its short side would make 16 x 128,000,000 pixels
    (6 GB) before cutting its 16 x 16 centre; with 1.5 GB to spare the image is classified with the others."""
    from vitkit.data.image import decode_for

    tall = tmp_path / "tall.png"
    Image.new("L", (1, 8_000_000), 90).save(tall, optimize=True)
    model = vitkit.load(ckpts[0])
    with _address_space(1536 << 20):
        x = decode_for(tall, model.config)
        code = main(["predict", str(images[0]), str(tall), str(images[1]), "--checkpoint", str(ckpts[0]),
                     "--format", "jsonl", "--num-workers", "1", *CPU])
    assert tuple(x.shape) == (3, 16, 16) and int(x.min()) == int(x.max()) == 90
    assert code == 0, capsys.readouterr().err[-3000:]
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in recs] == [str(images[0]), str(tall), str(images[1])] and all("top" in r for r in recs)


def test_an_image_that_needs_more_memory_than_there_is_is_its_own_record(ckpts, images, tmp_path, capsys):
    """A PNG within the pixel limit whose decoding needs more memory than the process has: that image's error
    record (exit 1), the others classified."""
    big = tmp_path / "big.png"
    Image.new("RGB", (8000, 7000), (10, 200, 30)).save(big)  # 56 Mpx: 168 MB as RGB, decoded, copied, converted
    # in a fresh process: a long-lived one (a pytest-xdist worker) may hold freed heap that the decode would reuse
    # without growing its address space, so the limit would not bite
    script = ("import sys, resource\n"
              "from vitkit.cli import main\n"
              "size = int(next(x for x in open('/proc/self/status') if x.startswith('VmSize:')).split()[1]) * 1024\n"
              "resource.setrlimit(resource.RLIMIT_AS, (size + (320 << 20), resource.RLIM_INFINITY))\n"
              "sys.exit(main(sys.argv[1:]))\n")
    argv = ["predict", str(images[0]), str(big), str(images[1]), "--checkpoint", str(ckpts[0]), "--format", "jsonl",
            "--num-workers", "0", *CPU]
    env = {**os.environ, "PYTHONPATH": str(VITKIT_ROOT), "VITKIT_GEMM": "onednn-packed", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [r["image"] for r in recs] == [str(images[0]), str(big), str(images[1])]
    assert "top" in recs[0] and "top" in recs[2] and "memory" in recs[1]["error"]


# ---- 5. CSV lists ------------------------------------------------------------------------------------------------

def test_a_csv_list_with_a_10_mb_field_is_one_line_naming_the_file_and_line(ckpts, tmp_path, capsys):
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n" + "x" * 10_000_000 + ",cat\n")
    assert main(["predict", str(listing), "--checkpoint", str(ckpts[0]), *CPU]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"{listing} line 2" in line and "field" in line


def test_every_other_output_refuses_a_fifo_or_a_device_too(ckpts, tmp_path, capsys):
    """export, eval's report and figure, and a figure of `explain` go through the same check as --out: a FIFO or a
    device where the file would go is refused by name and left as it was (an exporter would block on the FIFO)."""
    fifo, dev = tmp_path / "m.onnx", tmp_path / "report"
    os.mkfifo(fifo)
    assert main(["export", str(ckpts[0]), str(fifo)]) == 2
    assert "FIFO" in capsys.readouterr().err and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    from vitkit.evaluation.metrics import EvalResult, write_report

    dev.mkdir()
    node = dev / "eval_report.json"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(UsageError, match="character device"):
        write_report(EvalResult(acc1=1.0, acc5=1.0, loss=0.0, n=1, skipped=0, per_class=[1.0],
                                confusion=np.ones((1, 1)), classes=["a"]), node)
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_an_output_folder_that_is_not_a_folder_is_one_line_before_the_work(ckpts, images, tmp_path, capsys):
    """explain's, eval's and train's output folders: a FIFO, a device or a link to nowhere where the folder would go
    was an unexpected FileExistsError (exit 1), and eval's only after the whole evaluation: now one line, exit 2,
    before any work, the node left as it was."""
    fifo, dangling = tmp_path / "fifo", tmp_path / "dangling"
    os.mkfifo(fifo)
    dangling.symlink_to(tmp_path / "nowhere")
    assert main(["explain", str(images[0]), "--checkpoint", str(ckpts[0]), "--out", str(fifo)]) == 2
    assert "not a folder" in _one_line_error(capsys.readouterr().err)
    assert main(["eval", str(ckpts[0]), "--test-dir", str(tmp_path / "missing"), "--out", str(dangling)]) == 2
    assert "link to nowhere" in _one_line_error(capsys.readouterr().err)  # before the (missing) test data is read
    assert main(["train", "fashion-mnist", "data.dataset=digits", "--smoke", f"run.out_dir={fifo}", "--max-steps",
                 "1"]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(dangling)
