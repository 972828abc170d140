"""Batched augmentation on the training device (DeiT / AugReg recipes, App. B of the ViT paper for fine-tuning).

All geometric ops of a sample (random-resized-crop or pad-and-crop, flip, RandAugment's rotate, shear
and translate) are composed into one affine matrix, and the whole batch is resampled with a single
`grid_sample`. Pixel ops (RandAugment's colour ops) act on per-sample masks; mixup/cutmix and random
erasing act on the batch. Input: uint8 (B, C, H, W); output: normalised float32 (B, C, H', W').
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ..errors import UsageError


@dataclass
class AugConfig:
    """Training augmentation.

    Args:
        crop: "pad" (pad-and-crop by `pad` pixels, for small images), "rrc" (random-resized-crop with
            area `scale` and aspect `ratio`: of image files, cut from the full-resolution image in the DataLoader
            workers; of in-memory data, on the batch), or "none".
        hflip: random horizontal flips.
        hflip_alternate: airbench's derandomised flip (Jordan 2024, arXiv 2404.00498, Sec. 3.6): each training
            image is mirrored on alternate epochs, from a fixed coin of its own (the run's seed and its index) on the
            first, instead of a fresh coin every epoch; under data.prune its side follows the parity of the pass, so
            an image left out of a pass shows the same side on the passes either side of it. With `hflip`, for
            training sets held in memory at one size (`alternate_flip`).
        randaugment: "n,m": n ops per image at magnitude m (0-10), e.g. "2,9"; empty for none.
        mixup, cutmix: Beta alphas (0 disables); when both are on, one of them per batch.
        mix_prob: probability of mixing a batch.
        label_smoothing: for the cross-entropy targets.
        random_erasing: probability of erasing a random rectangle per image.
    """

    crop: str = "pad"
    pad: int = 2
    scale: tuple[float, float] = (0.35, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    hflip_alternate: bool = False
    randaugment: str = ""
    mixup: float = 0.0
    cutmix: float = 0.0
    mix_prob: float = 1.0
    label_smoothing: float = 0.1
    random_erasing: float = 0.0


def flip_coins(n: int, seed: int) -> torch.Tensor:
    """(n,) bool: the fixed coin of each of n training images under `aug.hflip_alternate`, drawn from the seed."""
    # 2**40 past anything the run's other streams (epochs, passes, steps) seed their generators with
    return torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed * 1_000_081 + (1 << 40))).bool()


def alternate_flip(x: torch.Tensor, coins: torch.Tensor, parity: torch.Tensor | int) -> torch.Tensor:
    """uint8 (B, C, H, W) images mirrored where their coin differs from the parity of their pass
    (`aug.hflip_alternate`): an image shows one side on even passes and the other on odd ones. `coins`: (B,) bool;
    `parity`: the pass number (per image, or one for all)."""
    flip = coins.to(x.device) ^ (torch.as_tensor(parity, device=x.device) % 2).bool()
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def _uniform(n: int, lo: float, hi: float, g: torch.Generator, device) -> torch.Tensor:
    return torch.rand(n, generator=g, device=device) * (hi - lo) + lo


def _rand_sign(n: int, g: torch.Generator, device) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=g, device=device).float() * 2 - 1


GEOMETRIC_OPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
PIXEL_OPS = ("identity", "autocontrast", "equalize", "invert", "posterize", "solarize", "solarize_add",
             "color", "contrast", "brightness", "sharpness")
RA_OPS = PIXEL_OPS + GEOMETRIC_OPS


def _blend(a: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (b + (a - b) * f.view(-1, 1, 1, 1)).clamp(0, 1)  # f = 1 gives a, f = 0 gives b


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def equalize(x: torch.Tensor) -> torch.Tensor:
    """Histogram equalisation per image and channel, vectorised (x in [0, 1])."""
    b, c, h, w = x.shape
    v = (x * 255).round().long().view(b * c, -1)  # (BC, HW)
    hist = torch.zeros(b * c, 256, device=x.device).scatter_add_(1, v, torch.ones_like(v, dtype=torch.float))
    cdf = hist.cumsum(1)
    cdf_min = torch.where(hist > 0, cdf, torch.full_like(cdf, float("inf"))).min(1, keepdim=True).values
    lut = ((cdf - cdf_min) / (h * w - cdf_min).clamp(min=1)).clamp(0, 1)
    return lut.gather(1, v).view(b, c, h, w)


def _pixel_op(name: str, x: torch.Tensor, mag: float, g: torch.Generator) -> torch.Tensor:
    n, dev = x.shape[0], x.device
    if name == "identity":
        return x
    if name == "autocontrast":
        lo = x.amin(dim=(2, 3), keepdim=True)
        hi = x.amax(dim=(2, 3), keepdim=True)
        return torch.where(hi > lo, (x - lo) / (hi - lo).clamp(min=1e-6), x)
    if name == "equalize":
        return equalize(x)
    if name == "invert":
        return 1 - x
    if name == "posterize":
        bits = 8 - int(mag / 10 * 4)
        return torch.floor(x * 255 / 2 ** (8 - bits)) * 2 ** (8 - bits) / 255
    if name == "solarize":
        thresh = 1 - mag / 10
        return torch.where(x >= thresh, 1 - x, x)
    if name == "solarize_add":
        return torch.where(x < 0.5, (x + mag / 10 * 110 / 255).clamp(0, 1), x)
    f = 1 + _rand_sign(n, g, dev) * 0.9 * mag / 10
    if name == "color":
        return _blend(x, _gray(x).expand_as(x), f)
    if name == "contrast":
        return _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x), f)
    if name == "brightness":
        return _blend(x, torch.zeros_like(x), f)
    if name == "sharpness":
        k = torch.tensor([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=x.dtype, device=dev) / 13
        blur = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), k.expand(x.shape[1], 1, 3, 3), groups=x.shape[1])
        return _blend(x, blur, f)
    raise ValueError(name)


class BatchAugment:
    """Turns uint8 batches into normalised, augmented float batches and (soft) targets."""

    def __init__(self, cfg: AugConfig, out_size: tuple[int, int], mean, std, num_classes: int, replicate_to: int | None = None):
        self.cfg, self.out_size, self.num_classes = cfg, tuple(out_size), num_classes
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.replicate_to = replicate_to
        self.ra_n, self.ra_m = 0, 0.0
        if cfg.randaugment:
            n, m = cfg.randaugment.split(",")
            self.ra_n, self.ra_m = int(n), float(m)
        if cfg.crop not in ("pad", "rrc", "none"):
            raise UsageError(f"crop must be 'pad', 'rrc' or 'none', got {cfg.crop!r}")

    @property
    def mixing(self) -> bool:
        return self.cfg.mixup > 0 or self.cfg.cutmix > 0

    def _to_float(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / 255
        if self.replicate_to and x.shape[1] == 1:
            x = x.expand(-1, self.replicate_to, -1, -1)
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    def _affine(self, b: int, h: int, w: int, g: torch.Generator, dev) -> tuple[torch.Tensor, bool]:
        """Per-sample 3x3 matrices mapping output to input normalised coordinates; and whether any is fractional."""
        c = self.cfg
        theta = torch.eye(3, device=dev).repeat(b, 1, 1)
        smooth = tuple(self.out_size) != (h, w)
        if c.crop == "rrc":
            area = _uniform(b, *c.scale, g, dev)
            logr = _uniform(b, math.log(c.ratio[0]), math.log(c.ratio[1]), g, dev)
            cw = torch.sqrt(area * logr.exp()).clamp(max=1)
            ch = torch.sqrt(area / logr.exp()).clamp(max=1)
            theta[:, 0, 0], theta[:, 1, 1] = cw, ch
            theta[:, 0, 2] = _uniform(b, -1, 1, g, dev) * (1 - cw)
            theta[:, 1, 2] = _uniform(b, -1, 1, g, dev) * (1 - ch)
            smooth = True
        elif c.crop == "pad" and c.pad > 0:
            tx = torch.randint(-c.pad, c.pad + 1, (b,), generator=g, device=dev).float()
            ty = torch.randint(-c.pad, c.pad + 1, (b,), generator=g, device=dev).float()
            theta[:, 0, 2], theta[:, 1, 2] = 2 * tx / w, 2 * ty / h
        if c.hflip:
            flip = torch.rand(b, generator=g, device=dev) < 0.5  # drawn either way: the draws after it stay the same
            if not c.hflip_alternate:  # the stream of batches mirrored them already (`alternate_flip`)
                theta[flip, :, 0] *= -1
        return theta, smooth

    def _randaugment_geometric(self, ops: torch.Tensor, g: torch.Generator, dev) -> torch.Tensor:
        """(B, 3, 3) from RandAugment's geometric picks (ops: (B, n) indices into RA_OPS)."""
        b = ops.shape[0]
        m = self.ra_m / 10
        mats = torch.eye(3, device=dev).repeat(b, 1, 1)
        for slot in range(ops.shape[1]):
            step = torch.eye(3, device=dev).repeat(b, 1, 1)
            sign = _rand_sign(b, g, dev)
            for k, name in enumerate(RA_OPS):
                if name not in GEOMETRIC_OPS:
                    continue
                sel = ops[:, slot] == k
                if not sel.any():
                    continue
                if name == "rotate":
                    a = sign[sel] * math.radians(30 * m)
                    step[sel, 0, 0], step[sel, 0, 1] = a.cos(), -a.sin()
                    step[sel, 1, 0], step[sel, 1, 1] = a.sin(), a.cos()
                elif name == "shear_x":
                    step[sel, 0, 1] = sign[sel] * 0.3 * m
                elif name == "shear_y":
                    step[sel, 1, 0] = sign[sel] * 0.3 * m
                elif name == "translate_x":
                    step[sel, 0, 2] = sign[sel] * 0.45 * m * 2
                elif name == "translate_y":
                    step[sel, 1, 2] = sign[sel] * 0.45 * m * 2
            mats = mats @ step
        return mats

    def __call__(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (B, C, H, W), labels (B,) -> normalised float (B, C, H', W'), targets (B,) or soft (B, K)."""
        dev = x.device
        x = self._to_float(x)
        b, _, h, w = x.shape
        theta, smooth = self._affine(b, h, w, g, dev)
        ops = None
        if self.ra_n:
            ops = torch.randint(0, len(RA_OPS), (b, self.ra_n), generator=g, device=dev)
            geo = torch.isin(ops, torch.tensor([RA_OPS.index(o) for o in GEOMETRIC_OPS], device=dev))
            if geo.any():
                theta = theta @ self._randaugment_geometric(ops, g, dev)
                smooth = True
        if smooth or not torch.equal(theta, torch.eye(3, device=dev).expand_as(theta)):
            grid = F.affine_grid(theta[:, :2], [b, x.shape[1], *self.out_size], align_corners=False)
            x = F.grid_sample(x, grid, mode="bilinear" if smooth else "nearest", padding_mode="zeros", align_corners=False)
        if ops is not None:
            for slot in range(self.ra_n):
                for k, name in enumerate(PIXEL_OPS):
                    sel = ops[:, slot] == k
                    if name != "identity" and sel.any():
                        x[sel] = _pixel_op(name, x[sel], self.ra_m, g)
        x = self.normalize(x)
        if self.cfg.random_erasing > 0:
            x = self._erase(x, g)
        if self.mixing:
            return self._mix(x, y, g)
        return x, y

    def _erase(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        b, c, h, w = x.shape
        dev = x.device
        do = torch.rand(b, generator=g, device=dev) < self.cfg.random_erasing
        area = _uniform(b, 0.02, 1 / 3, g, dev) * h * w
        logr = _uniform(b, math.log(0.3), math.log(1 / 0.3), g, dev)
        eh = torch.sqrt(area * logr.exp()).round().clamp(1, h)
        ew = torch.sqrt(area / logr.exp()).round().clamp(1, w)
        top = (torch.rand(b, generator=g, device=dev) * (h - eh + 1)).floor()
        left = (torch.rand(b, generator=g, device=dev) * (w - ew + 1)).floor()
        rows = torch.arange(h, device=dev).view(1, h, 1)
        cols = torch.arange(w, device=dev).view(1, 1, w)
        box = (rows >= top.view(-1, 1, 1)) & (rows < (top + eh).view(-1, 1, 1)) & (cols >= left.view(-1, 1, 1)) & (cols < (left + ew).view(-1, 1, 1))
        box = (box & do.view(-1, 1, 1)).unsqueeze(1)  # (B, 1, H, W)
        noise = torch.randn(x.shape, generator=g, device=dev)
        return torch.where(box, noise, x)

    def _mix(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c, dev = self.cfg, x.device
        k, eps = self.num_classes, c.label_smoothing
        one_hot = torch.full((len(y), k), eps / k, device=dev).scatter_(1, y.view(-1, 1), 1 - eps + eps / k)
        if torch.rand(1, generator=g, device=dev).item() >= c.mix_prob:
            return x, one_hot
        use_cutmix = c.cutmix > 0 and (c.mixup <= 0 or torch.rand(1, generator=g, device=dev).item() < 0.5)
        alpha = c.cutmix if use_cutmix else c.mixup
        lam = _beta(alpha, g, dev)
        x2 = x.flip(0)
        if use_cutmix:
            h, w = x.shape[-2:]
            ch, cw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy = int(torch.randint(0, h, (1,), generator=g, device=dev))
            cx = int(torch.randint(0, w, (1,), generator=g, device=dev))
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
            x = x.clone()
            x[:, :, y0:y1, x0:x1] = x2[:, :, y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        else:
            x = x * lam + x2 * (1 - lam)
        return x, one_hot * lam + one_hot.flip(0) * (1 - lam)


def _beta(alpha: float, g: torch.Generator, dev) -> float:
    """A Beta(alpha, alpha) draw from the given generator, by Johnk's method (exact for any alpha > 0)."""
    for _ in range(100):
        u = torch.rand(2, generator=g, device=dev)
        a, b = u[0].item() ** (1 / alpha), u[1].item() ** (1 / alpha)
        if a + b <= 1 and a + b > 0:
            return a / (a + b)
    return 0.5
