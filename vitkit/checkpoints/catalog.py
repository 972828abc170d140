"""The public pretrained checkpoints by name, downloaded into a cache ($VITKIT_HOME, default ~/.cache/vitkit).

Downloads resume from a partial file (HTTP Range) and fail offline with a message naming the URL to fetch by
hand and the path to put it at. Every download is verified when a checksum is known: one recorded in the catalog
(`sha256=` of `register_checkpoint`, or an MD5 where that is all a publisher gives), else the one the server
publishes with the file: Google Cloud Storage sends the object's MD5 (`x-goog-hash`), the Hugging Face hub the
SHA-256 of every LFS file (`x-linked-etag` on its redirect). A download whose server states no hash is
unverified, and `vitkit catalog` says so. Each download has an overall deadline besides its per-read timeout
(`vitkit.safety.Deadline`: VITKIT_FETCH_DEADLINE_S, default 60 s, plus the file's size at VITKIT_FETCH_MIN_RATE,
default 100 kB/s): a server that sends one byte at a time is cut off, the partial file kept for the next try.

Files on the Hugging Face hub (timm's and transformers' repositories) are fetched with `huggingface_hub`, into the
cache timm and transformers share (HF_HOME, HF_HUB_CACHE), at a revision (a branch, tag or commit), honouring
HF_ENDPOINT and offline mode (HF_HUB_OFFLINE=1: the cache only; a hub whose endpoint does not answer a TCP connect
within 3 s: the cache only too, at once, instead of huggingface_hub's 24 s of retries). The cache names each weight file by its SHA-256
(the hub's LFS object id), which vitkit checks once per file. Offline, the error names the repository, the revision
and how to put the files in place.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import cache_dir
from ..download import download, server_hash_kind, sha256_of
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
    repo: str | None = None  # a Hugging Face hub repository: fetched with huggingface_hub
    revision: str = "main"

    @property
    def is_folder(self) -> bool:
        return len(self.files) > 1

    @property
    def verification(self) -> str:
        """How a download of this entry is checked: a recorded SHA-256, the hash its server publishes, or not at all."""
        if self.repo:
            return "sha256 / git blob id published by the Hugging Face hub (huggingface_hub cache)"
        kinds = set()
        for fname, url in self.files.items():
            if fname in self.sha256:
                kinds.add("sha256 recorded in the catalog")
            else:
                kinds.add({"gcs": "md5 published by Google Cloud Storage",
                           "hf": "sha256 / git blob id published by the Hugging Face hub"}.get(server_hash_kind(url) or "", "unverified"))
        return "; ".join(sorted(kinds))


CATALOG: dict[str, CatalogEntry] = {}


def register_checkpoint(name: str, files: dict[str, str] | str, format: str, description: str = "",
                        sha256: dict[str, str] | None = None, repo: str | None = None,
                        revision: str = "main") -> CatalogEntry:
    """Add (or replace) a named checkpoint. `files` maps cache file names to URLs (a single URL is allowed); with
    `repo` (a Hugging Face hub repository id), the file names of that repository at `revision`, fetched with
    huggingface_hub (the URLs are then for display)."""
    if isinstance(files, str):
        files = {files.rsplit("/", 1)[-1].split("?")[0]: files}
    entry = CatalogEntry(name, dict(files), format, description, dict(sha256 or {}), repo, revision)
    CATALOG[name] = entry
    return entry


def _official(name: str, path: str, desc: str) -> None:
    register_checkpoint(name, f"{GCS}/{path}", "official-npz", desc)


def register_hub(repo: str, format: str, description: str = "", revision: str = "main",
                 files: tuple[str, ...] | None = None) -> CatalogEntry:
    """A Hugging Face hub repository as a catalog entry named by its id: timm and transformers folders both carry a
    config.json (timm's holds the preprocessing and the class names; transformers' a preprocessor_config.json)."""
    files = files or (("config.json", "model.safetensors") + (("preprocessor_config.json",) if format == "hf" else ()))
    urls = {f: f"{HF_HUB}/{repo}/resolve/{revision}/{f}" for f in files}
    return register_checkpoint(repo, urls, format, description, repo=repo, revision=revision)


def _hub(repo: str, desc: str, fmt: str) -> None:
    register_hub(repo, fmt, desc)


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
    "R_Ti_16": "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_224",
}
for _m, _f in _AUGREG.items():
    _official(f"augreg-{_m}-i1k", f"augreg/{_f}.npz", f"AugReg {_m}, i21k -> ImageNet-1k, 224")
# R+Ti/16: the ResNet stem alone before an 8x8 patch embedding (registry name r_vit_ti16), at 224 and 384.
_RTI = "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"
_official("augreg-R_Ti_16-i21k", f"augreg/{_RTI}.npz", "AugReg R+Ti/16, ImageNet-21k pre-training")
_official("augreg-R_Ti_16-384-i1k", f"augreg/{_RTI}--imagenet2012-steps_20k-lr_0.03-res_384.npz",
          "AugReg R+Ti/16, i21k -> ImageNet-1k, 384")
# timm and Hugging Face hub copies.
for _r in ("timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", "timm/vit_small_patch16_224.augreg_in21k_ft_in1k",
           "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", "timm/vit_large_patch16_224.augreg_in21k_ft_in1k",
           "timm/vit_base_r50_s16_384.orig_in21k_ft_in1k", "timm/resnetv2_50x1_bit.goog_in21k_ft_in1k",
           "timm/vit_tiny_r_s16_p8_224.augreg_in21k_ft_in1k", "timm/vit_tiny_r_s16_p8_384.augreg_in21k_ft_in1k"):
    _hub(_r, "timm hub weights", "timm")
for _r in ("google/vit-base-patch16-224", "google/vit-base-patch16-384", "google/vit-large-patch16-224",
           "google/vit-base-patch16-224-in21k", "google/vit-huge-patch14-224-in21k"):
    _hub(_r, "Hugging Face hub weights", "hf")
# The ViTs that followed the paper, as timm and transformers publish them (vitkit's registry has their sizes).
for _r, _d in [
    ("timm/vit_small_patch14_dinov2.lvd142m", "DINOv2 ViT-S/14, LVD-142M, 518 (backbone)"),
    ("timm/vit_base_patch14_dinov2.lvd142m", "DINOv2 ViT-B/14, LVD-142M, 518 (backbone)"),
    ("timm/vit_large_patch14_dinov2.lvd142m", "DINOv2 ViT-L/14, LVD-142M, 518 (backbone)"),
    ("timm/vit_giant_patch14_dinov2.lvd142m", "DINOv2 ViT-g/14 (SwiGLU), LVD-142M, 518 (backbone)"),
    ("timm/vit_small_patch14_reg4_dinov2.lvd142m", "DINOv2 ViT-S/14 with 4 registers, 518 (backbone)"),
    ("timm/vit_base_patch14_reg4_dinov2.lvd142m", "DINOv2 ViT-B/14 with 4 registers, 518 (backbone)"),
    ("timm/deit3_small_patch16_224.fb_in1k", "DeiT-III ViT-S/16, ImageNet-1k"),
    ("timm/deit3_base_patch16_224.fb_in22k_ft_in1k", "DeiT-III ViT-B/16, ImageNet-21k -> 1k"),
    ("timm/vit_base_patch16_siglip_224.webli", "SigLIP ViT-B/16 image tower, WebLI (MAP head)"),
    ("timm/vit_base_patch16_siglip_224.v2_webli", "SigLIP 2 ViT-B/16 image tower, WebLI (MAP head)"),
    ("timm/vit_so400m_patch14_siglip_224.webli", "SigLIP So400m/14 image tower, WebLI"),
    ("timm/eva02_tiny_patch14_224.mim_in22k", "EVA-02-Ti/14, MIM on ImageNet-22k (backbone)"),
    ("timm/eva02_small_patch14_224.mim_in22k", "EVA-02-S/14, MIM on ImageNet-22k (backbone)"),
    ("timm/eva02_base_patch14_224.mim_in22k", "EVA-02-B/14, MIM on ImageNet-22k (backbone)"),
    ("timm/eva02_tiny_patch14_336.mim_in22k_ft_in1k", "EVA-02-Ti/14, ImageNet-1k classifier at 336"),
    ("timm/vit_base_patch16_clip_quickgelu_224.openai", "OpenAI CLIP ViT-B/16 image tower"),
    ("timm/vit_large_patch14_clip_quickgelu_224.openai", "OpenAI CLIP ViT-L/14 image tower"),
]:
    register_hub(_r, "timm", _d)
for _r, _d in [
    ("facebook/dinov2-small", "DINOv2 ViT-S/14 (transformers Dinov2Model)"),
    ("facebook/dinov2-base", "DINOv2 ViT-B/14 (transformers Dinov2Model)"),
    ("facebook/dinov2-with-registers-small", "DINOv2 ViT-S/14 with registers (Dinov2WithRegistersModel)"),
    ("google/siglip-base-patch16-224", "SigLIP ViT-B/16 (SiglipModel: the image tower is loaded)"),
    ("openai/clip-vit-base-patch16", "OpenAI CLIP ViT-B/16 (CLIPModel: the image tower is loaded)"),
]:
    register_hub(_r, "hf", _d)
# The backbones of 2025-26 (DINOv3's repositories are gated: accept the licence on the hub, then `hf auth login`).
for _r, _d in [
    ("timm/vit_small_patch16_dinov3.lvd1689m", "DINOv3 ViT-S/16, LVD-1689M (backbone; timm pools the patch mean)"),
    ("timm/vit_base_patch16_dinov3.lvd1689m", "DINOv3 ViT-B/16, LVD-1689M (backbone)"),
    ("timm/vit_large_patch16_dinov3.lvd1689m", "DINOv3 ViT-L/16, LVD-1689M (backbone)"),
    ("timm/vit_large_patch16_dinov3.sat493m", "DINOv3 ViT-L/16, satellite SAT-493M (backbone)"),
    ("timm/vit_huge_plus_patch16_dinov3.lvd1689m", "DINOv3 ViT-H+/16 (SwiGLU), LVD-1689M (backbone)"),
    ("timm/vit_pe_core_base_patch16_224.fb", "Perception Encoder PE-Core-B/16 image tower (CLIP embedding head)"),
    ("timm/vit_pe_core_large_patch14_336.fb", "Perception Encoder PE-Core-L/14 at 336"),
    ("timm/vit_pe_spatial_base_patch16_512.fb", "Perception Encoder PE-Spatial-B/16 at 512 (dense features)"),
    ("timm/vit_pe_lang_large_patch14_448.fb", "Perception Encoder PE-Lang-L/14 at 448"),
    ("timm/aimv2_large_patch14_224.apple_pt", "AIMv2-L/14, 224 (backbone)"),
    ("timm/aimv2_huge_patch14_336.apple_pt", "AIMv2-H/14, 336 (backbone)"),
    ("timm/vit_base_patch16_rope_224.naver_in1k", "ROPE-ViT-B/16 axial, ImageNet-1k"),
    ("timm/vit_base_patch16_rope_mixed_224.naver_in1k", "ROPE-ViT-B/16 mixed (learned frequencies), ImageNet-1k"),
    ("timm/vit_base_patch14_reg1_tipsv2.webli", "TIPSv2 ViT-B/14 image tower, 448"),
]:
    register_hub(_r, "timm", _d)
for _r, _d in [
    ("facebook/dinov3-vits16-pretrain-lvd1689m", "DINOv3 ViT-S/16 (transformers DINOv3ViTModel; gated)"),
    ("facebook/dinov3-vitb16-pretrain-lvd1689m", "DINOv3 ViT-B/16 (transformers DINOv3ViTModel; gated)"),
    ("facebook/dinov3-vitl16-pretrain-lvd1689m", "DINOv3 ViT-L/16 (transformers DINOv3ViTModel; gated)"),
    ("apple/aimv2-large-patch14-224", "AIMv2-L/14 at 224 (transformers Aimv2VisionModel)"),
]:
    register_hub(_r, "hf", _d)
# Swin (Liu et al. 2021): timm's and transformers' hub copies, and the official release (microsoft/Swin-Transformer).
for _r, _d in [("timm/swin_tiny_patch4_window7_224.ms_in1k", "Swin-T, ImageNet-1k, 224"),
               ("timm/swin_small_patch4_window7_224.ms_in1k", "Swin-S, ImageNet-1k, 224"),
               ("timm/swin_base_patch4_window7_224.ms_in22k_ft_in1k", "Swin-B, ImageNet-22k -> 1k, 224"),
               ("timm/swin_base_patch4_window12_384.ms_in22k_ft_in1k", "Swin-B, ImageNet-22k -> 1k, 384 (window 12)")]:
    register_hub(_r, "timm", _d)
register_hub("microsoft/swin-tiny-patch4-window7-224", "hf", "Swin-T (transformers SwinForImageClassification)")
_SWIN_URL = "https://github.com/SwinTransformer/storage/releases/download/v1.0.0"
for _m in ("swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224", "swin_base_patch4_window7_224",
           "swin_base_patch4_window12_384"):
    register_checkpoint(_m + "-official", f"{_SWIN_URL}/{_m}.pth", "swin-official", f"{_m}: the paper's own release")
# DINOv2's own release (facebookresearch/dinov2): torch state dicts, read without unpickling code (weights_only).
_DINOV2_URL = "https://dl.fbaipublicfiles.com/dinov2"
for _m in ("vits14", "vitb14", "vitl14", "vitg14", "vits14_reg4", "vitb14_reg4"):
    register_checkpoint(f"dinov2_{_m}", f"{_DINOV2_URL}/dinov2_{_m.split('_')[0]}/dinov2_{_m}_pretrain.pth", "dinov2-release",
                        f"DINOv2 {_m}: the original release's backbone")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


# Seconds one TCP connect to the hub's endpoint may take before the hub counts as unreachable: without a network
# huggingface_hub retries each request five times with backoff (24 s) before it fails.
HUB_CONNECT_TIMEOUT_S = 3.0


def hub_unreachable(endpoint: str) -> str | None:
    """Why the hub at `endpoint` cannot be reached (one TCP connect to its host and port within
    HUB_CONNECT_TIMEOUT_S), or None if it can, or if a proxy is configured (the proxy decides: not probed)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return None
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    try:
        with socket.create_connection((u.hostname or "", u.port or (443 if u.scheme == "https" else 80)),
                                      timeout=HUB_CONNECT_TIMEOUT_S):
            return None
    except OSError as e:  # refused, no route, no DNS, timed out
        return f"{endpoint} cannot be reached: {e.strerror or e or type(e).__name__}"


def hub_download(repo: str, files: list[str], revision: str = "main") -> list[Path]:
    """Fetch files of a Hugging Face hub repository with huggingface_hub (its shared cache, HF_ENDPOINT, offline
    mode) and check each weight file's SHA-256 against the hub's id for it. A CheckpointError says what to do when
    the hub cannot be reached."""
    try:
        # huggingface_hub: its import costs start-up time, and only hub downloads need it
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise CheckpointError(f"{repo} is on the Hugging Face hub: pip install huggingface_hub") from e
    out = []
    endpoint = os.environ.get("HF_ENDPOINT") or None
    # no network: the cache only, at once (huggingface_hub would retry for 24 s before failing)
    unreachable = None if _offline() else hub_unreachable(endpoint or HF_HUB)
    for fname in files:
        try:
            path = hf_hub_download(repo, fname, revision=revision, endpoint=endpoint,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                   local_files_only=_offline() or unreachable is not None)
        except Exception as e:  # offline, unknown repo or revision, missing file, HTTP errors: one clear message
            cache = os.environ.get("HF_HUB_CACHE") or "~/.cache/huggingface/hub (HF_HOME, HF_HUB_CACHE)"
            why = (f"{unreachable}, and it is not in the cache" if unreachable else
                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise CheckpointError(
                f"could not get {fname} of the Hugging Face hub repository {repo!r} at revision {revision!r} "
                f"({why}). Offline, on a machine that can "
                f"reach the hub run `hf download {repo} {' '.join(files)} --revision {revision}` and copy its "
                f"models--{repo.replace('/', '--')} folder into {cache} here (then HF_HUB_OFFLINE=1 uses it), or put "
                f"{', '.join(files)} in a folder and load that folder") from e
        _verify_blob(Path(path))
        out.append(Path(path))
    return out


def _verify_blob(path: Path) -> None:
    """The hub cache stores a weight file as blobs/<sha256>: check the content once (a marker in VITKIT_HOME)."""
    blob = Path(os.path.realpath(path))
    if not re.fullmatch(r"[0-9a-f]{64}", blob.name):
        return  # a small file stored by its git blob id, or a cache without links: nothing recorded to check against
    marker = cache_dir() / "verified" / blob.name
    if marker.exists():
        return
    got = sha256_of(blob)
    if got != blob.name:
        raise CheckpointError(f"{path}: the hub cache's copy does not match its SHA-256 {blob.name} (got {got}): "
                              f"delete {blob} and load again")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def resolve(path_or_name: str | os.PathLike) -> Path:
    """A local path as is; a catalog name or an http(s)/file URL is downloaded into the cache first."""
    s = str(path_or_name)
    if s in CATALOG and CATALOG[s].repo:
        entry = CATALOG[s]
        paths = hub_download(entry.repo, list(entry.files), entry.revision)
        return paths[0].parent if entry.is_folder else paths[0]
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
