"""Tar shards (WebDataset layout): packed from a dataset, read by sample index locally and over HTTP Range, every
sample once per epoch across ranks and workers, mid-epoch resume exact."""
import http.server
import json
import subprocess
import sys
import tarfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vitkit.data.datasets import load_dataset
from vitkit.data.pack import pack
from vitkit.data.shards import ShardDataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "digits"
    pack("digits", out, shard_size=400)
    return out


class RangeServer(http.server.SimpleHTTPRequestHandler):
    """Files over HTTP/1.1 with `Range: bytes=a-b` (keep-alive), as object stores serve them."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng:
            a, b = rng.removeprefix("bytes=").split("-")
            data = data[int(a): int(b) + 1 if b else None]
            self.send_response(206)
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_pack_writes_what_tar_readers_read(shards):
    index = json.loads((shards / "train" / "index.json").read_text())
    assert index["num_samples"] == 1500 and [s["nsamples"] for s in index["shards"]] == [400, 400, 400, 300]
    with tarfile.open(shards / "train" / "shard-000001.tar") as tar:
        names = tar.getnames()
        assert names[:2] == ["000000400.png", "000000400.cls"]  # a sample's members together, as webdataset expects
        first_label = int(tar.extractfile("000000400.cls").read())
    ref = load_dataset("digits")
    assert first_label == int(ref.train.labels[400])
    ds = ShardDataset.open(str(shards / "train"), img_size=(8, 8))  # decoded at the digits' own size
    assert torch.equal(ds.labels, ref.train.labels) and ds.in_chans == 1
    for i in (0, 399, 400, 1499):
        x, y = ds[i]
        assert torch.equal(x, ref.train.images[i]) and y == int(ref.train.labels[i])  # PNG: lossless


def test_the_webdataset_library_reads_them(shards):
    """The peer reader: webdataset's own pipeline reads every sample with its class."""
    import webdataset as wds

    urls = sorted(str(p) for p in (shards / "train").glob("*.tar"))
    ref = load_dataset("digits").train
    got = list(wds.WebDataset(urls, shardshuffle=False).decode("l8").to_tuple("__key__", "png", "cls"))
    assert len(got) == 1500
    for key, img, cls in got[::97]:
        i = int(key)
        assert np.array_equal(np.asarray(img), ref.images[i, 0].numpy()) and int(cls) == int(ref.labels[i])


def test_shards_over_http_range_requests(shards):
    handler = lambda *a, **k: RangeServer(*a, directory=str(shards), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        spec = load_dataset(url, img_size=(8, 8))
        local = load_dataset(str(shards), img_size=(8, 8))
        assert len(spec.train) == 1500 and len(spec.test) == 297 and spec.classes == local.classes
        for i in (3, 777, 1200):
            assert torch.equal(spec.train[i][0], local.train[i][0])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_every_sample_once_across_ranks_and_workers_and_exact_resume(tmp_path, shards):
    """2 ranks x 2 DataLoader workers, a global batch of 60 (1500 = 25 x 60): together they read each sample of
    the epoch once; starting at step 10 gives exactly the batches an uninterrupted epoch gives from there."""
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, torch
        from vitkit.data.datasets import iterate_batches
        from vitkit.data.shards import ShardDataset

        class Indexed(ShardDataset):  # the sample's index as its payload: which samples did this rank read?
            def __getitem__(self, i):
                x, y = super().__getitem__(i)
                return torch.tensor([i]), y

        rank, world = int(sys.argv[1]), 2
        ds = Indexed.open({str(shards / "train")!r}, img_size=(8, 8))
        got = [x.flatten().tolist() for x, y, s in iterate_batches(ds, 60, seed=3, epoch=1, num_workers=2, rank=rank, world=world)]
        resumed = [x.flatten().tolist() for x, y, s in iterate_batches(ds, 60, seed=3, epoch=1, start_step=10, num_workers=2,
                                                                        rank=rank, world=world)]
        print(json.dumps({{"all": got, "resumed": resumed}}))
    """))
    runs = [json.loads(subprocess.run([sys.executable, str(script), str(r)], capture_output=True, text=True, check=True,
                                      cwd=REPO, env={"PYTHONPATH": str(REPO)}).stdout) for r in (0, 1)]
    seen = [i for run in runs for batch in run["all"] for i in batch]
    assert len(seen) == 1500 and sorted(seen) == list(range(1500))
    assert all(len(b) == 30 for run in runs for b in run["all"])
    for run in runs:
        assert run["resumed"] == run["all"][10:]


@pytest.mark.parametrize("crop", ["pad", "rrc"])  # rrc: random-resized crops cut in the DataLoader workers
def test_training_from_shards_resumes_exactly(tmp_path, shards, crop):
    from vitkit.training import apply_overrides, get_preset, train

    def cfg(out, **extra):
        c = get_preset("fashion-mnist")
        c.model.overrides = {}
        apply_overrides(c, {"data.dataset": str(shards), "data.batch_size": 50, "data.num_workers": 2, "model.name": "vit_ti16",
                            "model.overrides": {"img_size": 8, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2,
                                                "mlp_dim": 64}, "aug.pad": 1, "aug.crop": crop, "run.tta": "none", "run.progress": False,
                            "run.out_dir": str(out), "schedule.epochs": 1, "run.ckpt_every": 7, "run.eval_every": 1, **extra})
        return c

    full = train(cfg(tmp_path / "full"))
    assert full["step"] == 30 and full["acc1"] > 0.3  # one epoch of digits from PNG shards
    train(cfg(tmp_path / "cut"), max_steps=17)
    train(cfg(tmp_path / "cut"))
    a, b = load_file(tmp_path / "full" / "final.safetensors"), load_file(tmp_path / "cut" / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
