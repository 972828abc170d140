"""The input pipeline at ImageNet sizes: JPEG decoders per CPU core, and shard readers side by side.

    python benchmarks/input_pipeline.py decode [--images 200] [--seconds 4]    # decode + random-resized-crop + flip
    python benchmarks/input_pipeline.py readers [--images 2000] [--workers 2]  # one epoch of shards, 4 readers

`decode` makes 500x375 JPEGs (quality 90) from scikit-image's photos (random crops and flips of them, so no two are
alike) and times, on one thread, what a training worker does with each: decode, a random-resized crop (scale
0.08-1, ratio 3/4-4/3) to 224x224 with bilinear resampling, a random flip, as uint8. The decoders: Pillow as it
is; Pillow with `draft` (libjpeg decodes at 1/2, 1/4 or 1/8 when the crop is large enough to stay above 224 px);
simplejpeg (libjpeg-turbo, decoding at a reduced size the same way via min_height/min_width); PyTurboJPEG 1.x
(the system's libjpeg-turbo, scaling factors). Pillow-SIMD replaces Pillow, so it runs in its own venv:
`pip install pillow-simd numpy` there, and `... decode --keep /tmp/jpegs` here, then
`python benchmarks/input_pipeline.py decode --jpegs /tmp/jpegs --only pil pil-draft` there.
The readers need `pip install webdataset litdata datasets` (not vitkit's dependencies).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

OUT = 224
H, W = 375, 500


def make_jpegs(folder: Path, n: int, classes: int = 0) -> list[Path]:
    """n distinct 500x375 JPEGs from scikit-image's photos (in class sub-folders if `classes`)."""
    from PIL import Image
    from skimage import data as skd

    photos = [getattr(skd, name)() for name in ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry")]
    photos = [p if p.ndim == 3 else np.stack([p] * 3, -1) for p in photos]
    rng = random.Random(0)
    paths = []
    for i in range(n):
        img = Image.fromarray(photos[i % len(photos)][..., :3])
        scale = rng.uniform(1.0, 1.6)
        img = img.resize((max(W, int(img.width * scale * W / min(img.width, img.height))),
                          max(H, int(img.height * scale * W / min(img.width, img.height)))), Image.BILINEAR)
        left, top = rng.randint(0, img.width - W), rng.randint(0, img.height - H)
        img = img.crop((left, top, left + W, top + H))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        sub = folder / f"class{i % classes}" if classes else folder
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"{i:06d}.jpg"
        img.save(path, quality=90)
        paths.append(path)
    return paths


def rrc_box(rng: random.Random, w: int, h: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """The trainer's random-resized-crop box (torchvision's algorithm) as (left, top, width, height)."""
    from vitkit.data.image import random_resized_crop_box

    top, left, ch, cw = random_resized_crop_box(h, w, scale, ratio, rng)
    return left, top, cw, ch


def _reduction(cw: int, ch: int, limit: int = 8) -> int:
    """The largest power of 2 (<= limit) by which a cw x ch crop can shrink and stay at least OUT x OUT."""
    r = 1
    while r * 2 <= limit and cw // (r * 2) >= OUT and ch // (r * 2) >= OUT:
        r *= 2
    return r


def decoders() -> dict:
    from PIL import Image

    def finish(img, box, flip):  # img: PIL image of the crop's region at some scale; -> uint8 (224, 224, 3)
        img = img.resize((OUT, OUT), Image.BILINEAR, box=box)
        if flip:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(img)

    def pil(data: bytes, rng):
        img = Image.open(io.BytesIO(data)).convert("RGB")
        left, top, cw, ch = rrc_box(rng, img.width, img.height)
        return finish(img, (left, top, left + cw, top + ch), rng.random() < 0.5)

    def pil_draft(data: bytes, rng):
        img = Image.open(io.BytesIO(data))
        left, top, cw, ch = rrc_box(rng, img.width, img.height)
        r = _reduction(cw, ch)
        if r > 1:
            img.draft("RGB", (img.width // r, img.height // r))
        sx, sy = img.width / W, img.height / H  # the scale libjpeg decoded at
        img = img.convert("RGB")
        return finish(img, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy), rng.random() < 0.5)

    out = {"pil": pil, "pil-draft": pil_draft}
    try:
        import simplejpeg

        def sj(data: bytes, rng):
            w, h = simplejpeg.decode_jpeg_header(data)[:2]
            left, top, cw, ch = rrc_box(rng, w, h)
            r = _reduction(cw, ch)
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=h // r, min_width=w // r) if r > 1 else \
                simplejpeg.decode_jpeg(data, colorspace="RGB")
            sy, sx = arr.shape[0] / h, arr.shape[1] / w
            return finish(Image.fromarray(arr), (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy), rng.random() < 0.5)

        out["simplejpeg"] = sj
    except ImportError:
        pass
    try:
        from turbojpeg import TurboJPEG

        tj = TurboJPEG()

        def turbo(data: bytes, rng):
            w, h = tj.decode_header(data)[:2]
            left, top, cw, ch = rrc_box(rng, w, h)
            r = _reduction(cw, ch)
            arr = tj.decode(data, pixel_format=0, scaling_factor=(1, r) if r > 1 else None)  # TJPF_RGB
            sy, sx = arr.shape[0] / h, arr.shape[1] / w
            return finish(Image.fromarray(arr), (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy), rng.random() < 0.5)

        out["turbojpeg"] = turbo
    except (ImportError, RuntimeError, OSError):
        pass
    return out


def bench_decode(args) -> dict:
    import PIL

    if args.jpegs:  # made elsewhere (Pillow-SIMD's venv has no scikit-image: it would bring Pillow back)
        blobs = [p.read_bytes() for p in sorted(Path(args.jpegs).glob("*.jpg"))]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            blobs = [p.read_bytes() for p in make_jpegs(Path(tmp), args.images)]
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            for i, b in enumerate(blobs):
                (Path(args.keep) / f"{i:06d}.jpg").write_bytes(b)
    results = {}
    for name, fn in decoders().items():
        if args.only and name not in args.only:
            continue
        rng = random.Random(1)
        fn(blobs[0], rng)  # warm up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            assert fn(blobs[n % len(blobs)], rng).shape == (OUT, OUT, 3)
            n += 1
        rate = n / (time.perf_counter() - t0)
        results[name] = rate
        print(f"{name:<12} {rate:8.1f} img/s per core   cores for 2,900 img/s (B/16 training on an H100): {2900 / rate:5.1f}",
              flush=True)
    results["pillow"] = PIL.__version__
    return results


# ---- readers -------------------------------------------------------------------------------------------------

def _decode_224(data: bytes):
    from PIL import Image

    from vitkit.data.image import resize_crop, to_uint8_tensor

    return to_uint8_tensor(resize_crop(Image.open(io.BytesIO(data)).convert("RGB"), (OUT, OUT), 0.875, "bilinear"))


def bench_readers(args) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from vitkit.data.datasets import iterate_batches
    from vitkit.data.pack import pack
    from vitkit.data.shards import ShardDataset

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    make_jpegs(tmp / "jpg" / "train", args.images, classes=10)
    make_jpegs(tmp / "jpg" / "val", 10, classes=10)
    pack(str(tmp / "jpg"), tmp / "shards", shard_size=args.shard_size)
    urls = sorted(str(p) for p in (tmp / "shards" / "train").glob("*.tar"))
    results = {}

    def timed(name, batches) -> None:
        n, t0 = 0, time.perf_counter()
        for x in batches:
            n += len(x)
        dt = time.perf_counter() - t0
        results[name] = {"images": n, "seconds": dt, "img_per_s": n / dt}
        print(f"{name:<34} {n:6d} images  {n / dt:7.1f} img/s", flush=True)

    ds = ShardDataset.open(str(tmp / "shards" / "train"), img_size=(OUT, OUT), crop_pct=0.875)
    timed("vitkit ShardDataset (global shuffle)",
          (x for x, _, _ in iterate_batches(ds, 64, seed=0, epoch=0, num_workers=args.workers, drop_last=False)))
    try:
        import webdataset as wds

        pipe = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker)
                .shuffle(500).to_tuple("jpg", "cls").map_tuple(_decode_224, int).batched(64))
        timed("webdataset (shard + buffer shuffle)", (x for x, _ in DataLoader(pipe, batch_size=None, num_workers=args.workers)))
    except ImportError:
        print("webdataset: not installed")
    try:
        import datasets

        hf = datasets.load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)
        hf = hf.cast_column("jpg", datasets.Image(decode=False)).shuffle(seed=0, buffer_size=500)  # bytes, decoded as the others
        hf = hf.map(lambda s: {"x": _decode_224(s["jpg"]["bytes"]), "y": int(s["cls"])}, remove_columns=["jpg", "cls", "__key__", "__url__"])
        timed("HF datasets streaming (buffer)", (b["x"] for b in DataLoader(hf.with_format("torch"), batch_size=64, num_workers=args.workers)))
    except ImportError:
        print("datasets: not installed")
    try:
        import litdata

        samples = [(ds.raw(i)[0], int(ds.labels[i])) for i in range(len(ds))]
        litdata.optimize(fn=_identity, inputs=samples, output_dir=str(tmp / "litdata"), chunk_bytes="16MB", num_workers=1)
        ld = litdata.StreamingDataset(str(tmp / "litdata"), shuffle=True, seed=0, transform=_litdata_decode)
        timed("litdata (own chunks, shuffled)", (x for x, _ in litdata.StreamingDataLoader(ld, batch_size=64, num_workers=args.workers)))
    except ImportError:
        print("litdata: not installed")
    return results


def _identity(sample):
    return sample


def _litdata_decode(sample):
    data, label = sample
    return _decode_224(data), label


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["decode", "readers"])
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=250)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--jpegs", default=None, help="decode: read the JPEGs from this folder instead of making them")
    p.add_argument("--keep", default=None, help="decode: also write the JPEGs it made to this folder")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.images is None:
        args.images = 200 if args.what == "decode" else 2000
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = bench_decode(args) if args.what == "decode" else bench_readers(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu(), "results": res}, indent=1))


def _cpu() -> str:
    try:
        info = dict(line.split(":", 1) for line in os.popen("lscpu").read().splitlines() if ":" in line)
        return f"{info['Model name'].strip()}, CPU family {info['CPU family'].strip()}"
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
