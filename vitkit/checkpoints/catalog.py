"""The public pretrained checkpoints by name, downloaded into a cache ($VITKIT_HOME, default ~/.cache/vitkit).

Downloads resume from a partial file (HTTP Range), are verified against a SHA-256 where one is known,
and fail offline with a message naming the URL to fetch by hand and the path to put it at.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .io import CheckpointError

GCS = "https://storage.googleapis.com/vit_models"
HF_HUB = "https://huggingface.co"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    files: dict[str, str]  # file name in the cache -> URL
    format: str  # "official-npz", "timm", "hf"
    description: str = ""
    sha256: dict[str, str] = field(default_factory=dict)  # file name -> hex digest, where known

    @property
    def is_folder(self) -> bool:
        return len(self.files) > 1


CATALOG: dict[str, CatalogEntry] = {}


def register_checkpoint(name: str, files: dict[str, str] | str, format: str, description: str = "",
                        sha256: dict[str, str] | None = None) -> CatalogEntry:
    """Add (or replace) a named checkpoint. `files` maps cache file names to URLs (a single URL is allowed)."""
    if isinstance(files, str):
        files = {files.rsplit("/", 1)[-1].split("?")[0]: files}
    entry = CatalogEntry(name, dict(files), format, description, dict(sha256 or {}))
    CATALOG[name] = entry
    return entry


def _official(name: str, path: str, desc: str) -> None:
    register_checkpoint(name, f"{GCS}/{path}", "official-npz", desc)


def _hub(repo: str, desc: str, fmt: str) -> None:
    files = {"model.safetensors": f"{HF_HUB}/{repo}/resolve/main/model.safetensors"}
    if fmt == "hf":
        files["config.json"] = f"{HF_HUB}/{repo}/resolve/main/config.json"
    register_checkpoint(repo, files, fmt, desc)


# The paper's release: ImageNet-21k pre-trained, and fine-tuned on ImageNet at 384 (the /32s at 384, B/16 at 224 too).
for _m in ("ViT-B_16", "ViT-B_32", "ViT-L_16", "ViT-L_32", "ViT-H_14", "R50+ViT-B_16"):
    _official(f"{_m}-i21k", f"imagenet21k/{_m}.npz", f"{_m}, ImageNet-21k pre-training (with pre-logits)")
    _official(f"{_m}-i1k", f"imagenet21k+imagenet2012/{_m}.npz", f"{_m}, fine-tuned on ImageNet-1k at 384")
_official("ViT-B_16-224-i1k", "imagenet21k+imagenet2012/ViT-B_16-224.npz", "ViT-B/16 fine-tuned on ImageNet-1k at 224")
_official("ViT-L_16-224-i1k", "imagenet21k+imagenet2012/ViT-L_16-224.npz", "ViT-L/16 fine-tuned on ImageNet-1k at 224")
# AugReg ("How to train your ViT"), i21k pre-training then ImageNet-1k fine-tuning at 224.
_AUGREG = {
    "Ti_16": "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "S_16": "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "S_32": "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
    "B_16": "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
    "B_32": "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_224",
    "L_16": "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.01-res_224",
    "R26_S_32": "R26_S_32-i21k-300ep-lr_0.001-aug_light0-wd_0.03-do_0.1-sd_0.1--imagenet2012-steps_20k-lr_0.03-res_224",
}
for _m, _f in _AUGREG.items():
    _official(f"augreg-{_m}-i1k", f"augreg/{_f}.npz", f"AugReg {_m}, i21k -> ImageNet-1k, 224")
# timm and Hugging Face hub copies.
for _r in ("timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", "timm/vit_small_patch16_224.augreg_in21k_ft_in1k",
           "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", "timm/vit_large_patch16_224.augreg_in21k_ft_in1k",
           "timm/vit_base_r50_s16_384.orig_in21k_ft_in1k", "timm/resnetv2_50x1_bit.goog_in21k_ft_in1k"):
    _hub(_r, "timm hub weights", "timm")
for _r in ("google/vit-base-patch16-224", "google/vit-base-patch16-384", "google/vit-large-patch16-224",
           "google/vit-base-patch16-224-in21k", "google/vit-huge-patch14-224-in21k"):
    _hub(_r, "Hugging Face hub weights", "hf")


def cache_dir() -> Path:
    return Path(os.environ.get("VITKIT_HOME", Path.home() / ".cache" / "vitkit")).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = 30.0) -> Path:
    """Fetch `url` to `dest`, resuming a partial `dest.part`; verify the SHA-256 if given."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"User-Agent": "vitkit", **({"Range": f"bytes={have}-"} if have else {})})
    try:
        if url.startswith("file://"):
            shutil.copyfile(urllib.request.url2pathname(url[len("file://"):]), part)
        else:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                resumed = have and r.status == 206
                with open(part, "ab" if resumed else "wb") as f:
                    shutil.copyfileobj(r, f, 1 << 20)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise CheckpointError(
            f"could not download {url} ({getattr(e, 'reason', e)}). If this machine is offline, fetch that URL by "
            f"hand and put the file at {dest} (a partial download is kept at {part} and resumed next time)"
        ) from e
    if sha256:
        got = _sha256(part)
        if got != sha256.lower():
            part.unlink()
            raise CheckpointError(f"checksum mismatch for {url}: expected sha256 {sha256}, got {got}; the download was removed")
    os.replace(part, dest)
    return dest


def resolve(path_or_name: str | os.PathLike) -> Path:
    """A local path as is; a catalog name or an http(s)/file URL is downloaded into the cache first."""
    s = str(path_or_name)
    if s in CATALOG:
        entry = CATALOG[s]
        folder = cache_dir() / entry.name.replace("/", "--")
        for fname, url in entry.files.items():
            download(url, folder / fname, entry.sha256.get(fname))
        return folder if entry.is_folder else folder / next(iter(entry.files))
    if s.startswith(("http://", "https://", "file://")):
        digest = hashlib.sha256(s.encode()).hexdigest()[:12]
        return download(s, cache_dir() / "urls" / digest / s.rsplit("/", 1)[-1].split("?")[0])
    p = Path(s).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}, and {s!r} is not in the catalog (vitkit.checkpoints.CATALOG)")
    return p
