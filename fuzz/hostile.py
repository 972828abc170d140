"""Hostile inputs, made on demand: the files a stranger could hand vitkit. The tests (tests/test_hostile.py) and the
README's reliability table run vitkit on each; every one must end in a clean refusal.

    python -m fuzz.hostile OUT      writes them all into OUT (the 8 GB npz bomb is an 8 MB file)
"""
from __future__ import annotations

import io
import json
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

CHUNK = 64 << 20


class _RepeatedDeflate:
    """A stand-in for zipfile's compressor that emits one precomputed, byte-aligned deflate block per chunk of
    zeros: the archive of an 8 GB array is written in seconds instead of compressing 8 GB."""

    def __init__(self) -> None:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        self.block = c.compress(bytes(CHUNK)) + c.flush(zlib.Z_FULL_FLUSH)  # resets the dictionary: repeatable
        self.tail = zlib.compressobj(9, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)  # an empty final block
        self.head = b""

    def compress(self, data: bytes) -> bytes:
        if len(data) == CHUNK:  # npz_bomb writes only zeros in chunks of this size
            return self.block
        c = zlib.compressobj(9, zlib.DEFLATED, -15)  # anything else (the .npy header): its own aligned blocks
        return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)

    def flush(self) -> bytes:
        return self.tail


def zip_bomb(path: Path, entry: str, head: bytes, gib: int) -> Path:
    """A zip archive whose one entry is `head` and then `gib` GiB of zeros, deflated into about gib MB."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        info = zipfile.ZipInfo(entry)
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            f._compressor = _RepeatedDeflate()  # zipfile still computes the CRC over every byte written
            f.write(head)
            zero = bytes(CHUNK)
            for _ in range(gib * (1 << 30) // CHUNK):
                f.write(zero)
    return path


def npz_bomb(path: Path, gib: int = 8, name: str = "embedding/kernel") -> Path:
    """An .npz whose one float32 array is `gib` GiB of zeros, deflated into about gib MB."""
    header = io.BytesIO()
    shape = (gib * (1 << 30) // 4,)
    np.lib.format.write_array_header_2_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return zip_bomb(path, f"{name}.npy", header.getvalue(), gib)


def pth_bomb(path: Path, gib: int = 8) -> Path:
    """A torch.save zip archive of a small state dict with an extra 8 GiB entry of deflated zeros."""
    import torch

    buf = io.BytesIO()
    torch.save({"patch_embed.proj.weight": torch.zeros(8, 3, 4, 4)}, buf)
    zip_bomb(path, "archive/data/9", b"", gib)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "a") as z:
        for info in src.infolist():
            z.writestr(info, src.read(info))
    return path


def npz_lying_header(path: Path) -> Path:
    """An .npz whose array header claims 10^12 elements over 16 bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("embedding/kernel.npy", header.getvalue() + bytes(16))
    return path


def safetensors_absurd(path: Path) -> Path:
    """A .safetensors whose one tensor claims shape (10^6, 10^6) at offsets far past the file's end."""
    header = json.dumps({"patch_embed.proj.weight": {"dtype": "F32", "shape": [10**6, 10**6],
                                                     "data_offsets": [0, 4 * 10**12]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    return path


def hf_folder_absurd(path: Path) -> Path:
    """A transformers ViT folder whose config.json claims a 10^9-pixel image and 10^6 heads."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({"vit.embeddings.patch_embeddings.projection.weight": torch.zeros(8, 3, 4, 4),
               "vit.embeddings.cls_token": torch.zeros(1, 1, 8),
               "vit.embeddings.position_embeddings": torch.zeros(1, 5, 8)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"],
                                                  "image_size": 10**9, "patch_size": 4, "hidden_size": 8,
                                                  "num_attention_heads": 10**6, "num_hidden_layers": 10**6,
                                                  "intermediate_size": 10**9}))
    return path


def deep_json_folder(path: Path, depth: int = 100_000) -> Path:
    """A hub folder whose config.json nests 100,000 lists (Python's JSON parser recurses)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("[" * depth + "]" * depth)
    (path / "model.safetensors").write_bytes(b"")
    return path


def yaml_python_tag(path: Path) -> Path:
    """A training config with a Python tag that runs a command under an unsafe loader."""
    path.write_text("optim:\n  lr: !!python/object/apply:os.system ['touch /tmp/vitkit-pwned']\n")
    return path


def yaml_laughs(path: Path) -> Path:
    """A 500-byte YAML whose aliases expand to 10^7 values ("billion laughs")."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, cur in zip("abcdef", "bcdefg"):
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def shards_absurd_row(root: Path, size: int = 10**12) -> Path:
    """A shard set of 3 tiny PNGs (3 classes) in root/train and root/test, whose test index claims `size` bytes for
    the second sample."""
    from PIL import Image

    from vitkit.data.pack import write_split

    def samples():
        for i in range(3):
            buf = io.BytesIO()
            Image.fromarray(np.full((8, 8, 3), 60 * i, np.uint8)).save(buf, format="PNG")
            yield buf.getvalue(), "png", i

    for split in ("train", "test"):
        write_split(samples(), root / split, ["a", "b", "c"], 3, name=split)
    idx = root / "test" / "shard-000000.idx.npy"
    rows = np.load(idx, allow_pickle=False)
    rows[1, 1] = size
    np.save(idx, rows, allow_pickle=False)
    return root


def png_bomb(path: Path, side: int = 50_000) -> Path:
    """A PNG of a few kB that decodes to side x side pixels."""
    row = b"\0" + bytes((side + 7) // 8)  # filter byte + a 1-bit row
    c = zlib.compressobj(9)
    data = b"".join(c.compress(row) for _ in range(side)) + c.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    ihdr = side.to_bytes(4, "big") * 2 + bytes([1, 0, 0, 0, 0])  # 1-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


ALL = {
    "bomb.npz": npz_bomb, "bomb.pth": pth_bomb, "lying.npz": npz_lying_header, "absurd.safetensors": safetensors_absurd,
    "absurd_hf": hf_folder_absurd, "deep_json": deep_json_folder, "python_tag.yaml": yaml_python_tag,
    "laughs.yaml": yaml_laughs, "shards": shards_absurd_row, "bomb.png": png_bomb,
}


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile")
    out.mkdir(parents=True, exist_ok=True)
    for name, make in ALL.items():
        print(make(out / name))
