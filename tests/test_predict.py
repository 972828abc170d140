"""`vitkit predict` over many images: folders, CSV lists and shard sets as inputs, records streamed per batch in the
service's schema, a clean stop on SIGTERM and `--resume` to the file an uninterrupted run writes."""
import csv
import io
import json
import shutil
import os
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
from vitkit.inference.predict import Progress, gather_inputs, predict, read_done, top_classes

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "bird", "fish"]
FP32 = ["--precision", "fp32", "--device", "cpu"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                            num_classes=4, class_names=CLASSES)
    torch.nn.init.normal_(m.head.weight, std=0.5)  # probabilities far from uniform: a ranking to compare
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    vitkit.save(m, path)
    return path


@pytest.fixture(autouse=True)
def _one_gemm(monkeypatch):
    """Runs compared bit for bit in this process take one GEMM path (none measured between them)."""
    from vitkit.machine import gemm

    monkeypatch.setattr(gemm, "FORCE", "onednn-packed")


def _png(path: Path, seed: int, size=(20, 24)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """root/: images at two depths, a corrupt one, a text file; a CSV list of some of them; a loose file."""
    root = tmp_path_factory.mktemp("imgs")
    for i, rel in enumerate(["set/b/2.png", "set/a/1.jpg", "set/a/deeper/3.png", "set/0.png", "list/x.png",
                             "list/sub/y.png", "loose.png"]):
        _png(root / rel, i, size=(20 + i, 24 + 2 * i))
    (root / "set" / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (root / "set" / "notes.txt").write_text("not an image")
    (root / "list" / "pred.csv").write_text("path,label\nsub/y.png,dog\nx.png,cat\n")
    return root


def _jsonl(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x]


def test_folders_csv_lists_and_files_mixed_give_the_records_of_the_files_alone(ckpt, tree, tmp_path, capsys):
    loose, folder, listing = tree / "loose.png", tree / "set", tree / "list" / "pred.csv"
    assert main(["predict", str(loose), str(folder), str(listing), "--checkpoint", str(ckpt), "--format", "jsonl",
                 "--batch-size", "3", "--top-k", "2", *FP32]) == 1  # broken.png: a record with its error, exit 1
    mixed = _jsonl(capsys.readouterr().out)
    # the folder: every image below it, sorted (the text file left out); the CSV: its rows, from its own folder
    files = [loose, folder / "0.png", folder / "a" / "1.jpg", folder / "a" / "broken.png", folder / "a" / "deeper" / "3.png",
             folder / "b" / "2.png", tree / "list" / "sub" / "y.png", tree / "list" / "x.png"]
    assert [r["image"] for r in mixed] == [str(f) for f in files]
    assert main(["predict", *map(str, files), "--checkpoint", str(ckpt), "--format", "jsonl", "--batch-size", "3",
                 "--top-k", "2", *FP32]) == 1
    assert _jsonl(capsys.readouterr().out) == mixed
    broken = mixed[3]
    assert set(broken) == {"image", "error"} and "cannot decode image" in broken["error"]
    for r in mixed[:3] + mixed[4:]:
        assert [set(t) for t in r["top"]] == [{"index", "label", "probability"}] * 2
        assert r["top"][0]["probability"] >= r["top"][1]["probability"]
        assert all(CLASSES[t["index"]] == t["label"] for t in r["top"])


def test_a_shard_set_is_an_input_and_gives_the_files_numbers(ckpt, tree, tmp_path, capsys):
    from vitkit.data.pack import pack

    pack(str(tree / "list" / "pred.csv"), tmp_path / "shards", shard_size=1)  # two shards of one image each
    assert main(["predict", str(tmp_path / "shards"), str(tree / "list" / "pred.csv"), "--checkpoint", str(ckpt),
                 "--format", "json", "--batch-size", "2", *FP32]) == 0
    recs = json.loads(capsys.readouterr().out)  # the json format: one array, streamed
    assert [r["image"] for r in recs] == [f"{tmp_path / 'shards' / 'train'}#{i:09d}" for i in range(2)] + [
        str(tree / "list" / "sub" / "y.png"), str(tree / "list" / "x.png")]
    for shard, file in zip(recs[:2], recs[2:]):  # the same bytes: the same classes and probabilities
        assert [t["index"] for t in shard["top"]] == [t["index"] for t in file["top"]]
        assert np.allclose([t["probability"] for t in shard["top"]], [t["probability"] for t in file["top"]], atol=1e-6)


def test_the_records_have_the_services_schema_and_numbers(ckpt, tree):
    """The same image through `vitkit serve` (its /predict) and through `vitkit predict`: the same entries."""
    import httpx

    from test_serve import Server
    from vitkit.serve import Limits, TorchPredictor, create_app

    model = vitkit.load(ckpt)
    img = tree / "set" / "b" / "2.png"
    srv = Server(create_app(TorchPredictor(model, precision="fp32"), Limits(), name="m"))
    try:
        r = httpx.post(f"{srv.url}/predict?top_k=4", content=img.read_bytes(), headers={"content-type": "image/png"})
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    served = r.json()["top"]
    rec = predict(vitkit.load(ckpt), [img], top_k=4)[0]
    assert [list(t) for t in rec["top"]] == [list(t) for t in served] == [["index", "label", "probability"]] * 4
    assert [(t["index"], t["label"]) for t in rec["top"]] == [(t["index"], t["label"]) for t in served]
    assert np.allclose([t["probability"] for t in rec["top"]], [t["probability"] for t in served], atol=1e-6)
    # both build their entries with one function
    assert top_classes(np.array([0.1, 0.6, 0.1, 0.2]), CLASSES, 3) == [
        {"index": 1, "label": "dog", "probability": 0.6}, {"index": 3, "label": "fish", "probability": 0.2},
        {"index": 0, "label": "cat", "probability": 0.1}]


def _many(root: Path, n: int) -> Path:
    for i in range(n):
        _png(root / f"{i // 100}" / f"{i:04d}.png", 1000 + i, size=(16, 16))
    return root


def _cli(*args) -> subprocess.Popen:
    # the three processes compared byte for byte compute alike: one GEMM path, one thread, fp32
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VITKIT_GEMM": "onednn-packed"}
    return subprocess.Popen([sys.executable, "-m", "vitkit.cli", "predict", *map(str, args), *FP32],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)


def test_sigterm_stops_after_a_batch_and_resume_ends_with_the_uninterrupted_file(ckpt, tmp_path):
    images = _many(tmp_path / "many", 600)
    common = [images, "--checkpoint", ckpt, "--batch-size", "4", "--num-workers", "1"]
    ref = _cli(*common, "--out", tmp_path / "ref.jsonl")
    _, err = ref.communicate()
    assert ref.returncode == 0, err.decode()[-2000:]
    err = err.decode()
    assert "vitkit: predict: 600/600 images (100%)" in err and "vitkit: predict: 60/600 images (10%)" in err  # progress
    out = tmp_path / "cut.jsonl"
    cut = _cli(*common, "--out", out)
    try:
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):  # a first batch written
            if cut.poll() is not None:
                raise AssertionError(f"the run ended before writing: {cut.stderr.read().decode()[-2000:]}")
            time.sleep(0.002)
    finally:
        cut.send_signal(signal.SIGTERM)
        code = cut.wait()
    err = cut.stderr.read().decode()
    assert code == 143, err[-2000:]
    assert "stopped by SIGTERM after" in err and "--resume" in err
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and 0 < len(lines) - 1 < 600 and (len(lines) - 1) % 4 == 0  # whole batches only
    resumed = _cli(*common, "--out", out, "--resume")
    _, err = resumed.communicate()
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert f"({len(lines) - 1:,} done earlier)" in err.decode()
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()


def test_resume_drops_a_cut_line_and_the_rest_of_its_batch(ckpt, tree, tmp_path, capsys):
    """A kill while a batch was being written (its last line cut short): the file resumes to the uninterrupted one,
    in JSON lines and in CSV; a file of other inputs or another --top-k is refused and left as it was."""
    images = _many(tmp_path / "imgs", 30)
    args = ["predict", str(images), str(tree / "set" / "a" / "broken.png"), "--checkpoint", str(ckpt),
            "--batch-size", "4", "--top-k", "3", *FP32]
    for suffix in (".jsonl", ".csv"):
        ref = tmp_path / f"ref{suffix}"
        assert main([*args, "--out", str(ref)]) == 1  # broken.png
        whole = ref.read_bytes()
        lines = whole.split(b"\n")
        # 22 whole lines and half of the 23rd: 22 records, or in csv the header and 7 records of 3 rows
        cut = b"\n".join(lines[:22]) + b"\n" + lines[22][: len(lines[22]) // 2]
        out = tmp_path / f"cut{suffix}"
        out.write_bytes(cut)
        capsys.readouterr()
        assert main([*args, "--out", str(out), "--resume"]) == 1  # broken.png, among the records written now
        err = capsys.readouterr().err
        kept = 22 if suffix == ".jsonl" else 7  # whole records before the cut; their batch of 4 is done again
        assert f"({kept - kept % 4:,} done earlier)" in err and "1 of 31 image(s) could not be read" in err
        assert out.read_bytes() == whole, suffix
        assert main([*args, "--out", str(out), "--resume"]) == 1  # all done: nothing to do, the file as it was
        assert out.read_bytes() == whole
        before = out.read_bytes()
        assert main([*args, "--out", str(out), "--resume", "--top-k", "2"]) == 2
        assert main([*args[:2], str(tree / "loose.png"), *args[2:], "--out", str(out), "--resume"]) == 2
        assert out.read_bytes() == before  # refused: untouched
        assert "other inputs or another order" in capsys.readouterr().err
    rows = list(csv.reader(io.StringIO((tmp_path / "ref.csv").read_text())))
    assert rows[0] == ["image", "rank", "index", "label", "probability", "error", "run"]  # run: what made each image's
    assert rows[1][6].startswith("model=") and rows[2][6] == ""  # rows, on its first row (resume checks it)
    assert rows[1][1:5] == ["1", rows[1][2], CLASSES[int(rows[1][2])], rows[1][4]] and rows[-1][5]  # broken.png last


def test_read_done_counts_whole_records_only(tmp_path):
    f = tmp_path / "o.jsonl"
    recs = [{"image": f"{i}.png", "top": [{"index": 0, "label": "a", "probability": 1.0}]} for i in range(4)]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs[:3]) + json.dumps(recs[3])[:-1] + "}")  # 3.png's, cut
    done = read_done(f, "jsonl", [f"{i}.png" for i in range(5)], 1)
    assert done.count == 3 and done.offset(3) == len(f.read_bytes()) - len(json.dumps(recs[0]))
    f.write_text(json.dumps({"image": "other.png", "error": "x"}) + "\n")
    with pytest.raises(vitkit.errors.UsageError, match="other inputs or another order"):
        read_done(f, "jsonl", ["0.png"], 1)


def test_progress_draws_a_bar_on_a_terminal_and_lines_elsewhere():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, plain = Tty(), io.StringIO()
    for stream in (tty, plain):
        bar = Progress(100, enabled=True, stream=stream)
        for _ in range(10):
            bar.update(10)
        bar.end()
    assert tty.getvalue().startswith("\rvitkit: predict [") and "100/100 images (100%)" in tty.getvalue()
    assert plain.getvalue().count("\n") == 10 and "\r" not in plain.getvalue()  # a line every tenth


def test_bad_output_options_are_refused_before_anything_runs(ckpt, tree, tmp_path):
    img = str(tree / "loose.png")
    for extra in (["--out", str(tmp_path / "o.parquet")], ["--resume"], ["--out", str(tmp_path / "o.json"), "--resume"],
                  ["--batch-size", "0"]):
        assert main(["predict", img, "--checkpoint", str(ckpt), *extra]) == 2, extra
    assert main(["predict", str(tmp_path / "empty"), "--checkpoint", str(ckpt)]) == 1  # a missing path: its record
    (tmp_path / "empty").mkdir()
    assert main(["predict", str(tmp_path / "empty"), "--checkpoint", str(ckpt)]) == 2  # no image at all
    assert not list(tmp_path.glob("o.*"))


def test_the_python_api_reads_the_same_inputs(ckpt, tree):
    inputs = gather_inputs([tree / "list" / "pred.csv", tree / "loose.png"])
    assert inputs.names == [str(tree / "list" / "sub" / "y.png"), str(tree / "list" / "x.png"), str(tree / "loose.png")]
    (tree / "list" / "paths.csv").write_text("sub/y.png\nx.png\n")  # a list of paths alone: labels are not needed
    assert gather_inputs([tree / "list" / "paths.csv"]).names == inputs.names[:2]
    recs = predict(vitkit.load(ckpt), inputs.names, top_k=1, batch_size=2, num_workers=2)
    assert [r["image"] for r in recs] == inputs.names and all(len(r["top"]) == 1 for r in recs)


def test_a_folder_of_images_with_its_own_index_json_is_a_folder(ckpt, tree, tmp_path):
    """A web folder's index.json (not a vitkit shard index) leaves it a folder of images."""
    web = tmp_path / "web"
    shutil.copytree(tree / "set", web)
    (web / "index.json").write_text('{"pages": []}')
    names = gather_inputs([web]).names
    assert len(names) == len(gather_inputs([tree / "set"]).names) and all(n.startswith(str(web)) for n in names)
