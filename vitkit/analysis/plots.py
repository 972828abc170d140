"""The figures: attention overlays (Fig. 6), embedding filters, position-embedding similarity and mean attention
distance (Fig. 7). Each returns the path of the PNG it wrote."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cache import atomic_write


def _plt():
    import matplotlib  # matplotlib: its import costs start-up time, and only figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: its import costs start-up time, and only figures need it

    return plt


def _save(fig, path: str | Path, dpi: int = 110) -> Path:
    path = Path(path)
    atomic_write(path, lambda p: fig.savefig(p, dpi=dpi, bbox_inches="tight", format=path.suffix[1:] or "png"))
    _plt().close(fig)
    return path


def upsample(map2d: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    m = torch.as_tensor(map2d, dtype=torch.float32)[None, None]
    return torch.nn.functional.interpolate(m, size=size, mode="bilinear", align_corners=False)[0, 0].numpy()


def overlay(image: np.ndarray, heat: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """Blend a [0, 1] heat map (as a colour map) over an RGB or grey uint8 image of the same size."""
    cmap = _plt().get_cmap("jet")
    img = image.astype(np.float32) / 255
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, -1)
    h = (heat - heat.min()) / max(float(heat.max() - heat.min()), 1e-12)
    return ((1 - alpha) * img + alpha * cmap(h)[..., :3]).clip(0, 1)


def save_explanation(image: np.ndarray, maps: dict[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """The image, then each named map overlaid on it, side by side."""
    plt = _plt()
    n = 1 + len(maps)
    fig, axes = plt.subplots(1, n, figsize=(3 * n, 3.3))
    axes = np.atleast_1d(axes)
    axes[0].imshow(image, cmap="gray" if image.ndim == 2 else None)
    axes[0].set_title("input", fontsize=9)
    for ax, (name, m) in zip(axes[1:], maps.items()):
        ax.imshow(overlay(image, upsample(torch.from_numpy(m), image.shape[:2])))
        ax.set_title(name, fontsize=9)
    for ax in axes:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def save_layer_head_grid(maps: dict[int, np.ndarray], path: str | Path, title: str = "") -> Path:
    """A grid: one row per layer, one column per head (maps (H, gh, gw) per layer)."""
    plt = _plt()
    layers = sorted(maps)
    heads = maps[layers[0]].shape[0]
    # constrained layout places the title, head labels and rows without the blank band a fixed margin leaves
    fig, axes = plt.subplots(len(layers), heads, figsize=(1.3 * heads, 1.3 * len(layers) + 0.4), squeeze=False,
                             layout="constrained")
    for r, li in enumerate(layers):
        for h in range(heads):
            ax = axes[r][h]
            ax.imshow(maps[li][h], cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if h == 0:
                ax.set_ylabel(f"layer {li}", fontsize=7)
            if r == 0:
                ax.set_title(f"head {h}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def save_register_attention(reg: dict[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """Register tokens apart from the patch maps: per layer, the class token's (mean over heads) and the patches'
    mean attention to each register; and the class token's rollout split between registers and patches."""
    plt = _plt()
    panels = 2 if "class_to_registers" in reg else 1
    fig, axes = plt.subplots(1, panels + (1 if "rollout_registers" in reg else 0), figsize=(4.2 * (panels + 1), 3.2),
                             squeeze=False, layout="constrained")
    axes = axes[0]
    series = [("patches_to_registers", "patches -> register (mean)")]
    if "class_to_registers" in reg:
        series.insert(0, ("class_to_registers", "class token -> register (mean over heads)"))
    for ax, (key, label) in zip(axes, series):
        a = reg[key] if reg[key].ndim == 2 else reg[key].mean(1)  # (L, R)
        for r in range(a.shape[1]):
            ax.plot(range(a.shape[0]), a[:, r], marker="o", ms=3, label=f"register {r}")
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("attention")
        ax.set_title(label, fontsize=8)
        ax.legend(fontsize=6)
    if "rollout_registers" in reg:
        ax = axes[-1]
        shares = list(reg["rollout_registers"]) + [float(reg["rollout_patches"])]
        ax.bar([f"reg {r}" for r in range(len(shares) - 1)] + ["patches"], shares, color="tab:purple")
        ax.set_title("class token's rollout: share per input", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def save_window_maps(maps: dict[int, np.ndarray], stage_of: list[int], shifted: set[int], path: str | Path,
                     title: str = "") -> Path:
    """A Swin's per-block window-attention maps (h, w), one row per stage; shifted-window blocks marked."""
    plt = _plt()
    stages = sorted(set(stage_of))
    cols = max(sum(1 for b in maps if stage_of[b] == s) for s in stages)
    fig, axes = plt.subplots(len(stages), cols, figsize=(1.6 * cols, 1.6 * len(stages) + 0.4), squeeze=False,
                             layout="constrained")
    for r, s in enumerate(stages):
        blocks = [b for b in sorted(maps) if stage_of[b] == s]
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(blocks):
                ax.imshow(maps[blocks[c]], cmap="viridis")
                ax.set_title(f"block {blocks[c]}" + (" (shifted)" if blocks[c] in shifted else ""), fontsize=7)
            else:
                ax.axis("off")
            if c == 0:
                ax.set_ylabel(f"stage {s}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def save_filters(components: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Principal components (k, C, P, P) as tiles, each scaled to [0, 1] (RGB, or grey for one channel)."""
    plt = _plt()
    k = components.shape[0]
    cols = min(7, k)
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 * cols, 1.2 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < k:
            c = components[i].numpy()
            c = (c - c.min()) / max(float(c.max() - c.min()), 1e-12)
            ax.imshow(c.transpose(1, 2, 0) if c.shape[0] == 3 else c[0], cmap=None if c.shape[0] == 3 else "gray")
    fig.suptitle(title or "RGB embedding filters (first principal components)", fontsize=9)
    return _save(fig, path)


def save_position_similarity(sim: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """(gh, gw, gh, gw) similarity as a grid of grids: tile (r, c) shows patch (r, c) against all patches."""
    plt = _plt()
    gh, gw = sim.shape[:2]
    fig, axes = plt.subplots(gh, gw, figsize=(max(4, 0.45 * gw + 1.5), max(4, 0.45 * gh)), squeeze=False)
    im = None
    for r in range(gh):
        for c in range(gw):
            ax = axes[r][c]
            im = ax.imshow(sim[r, c].numpy(), vmin=-1, vmax=1, cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(str(r + 1), fontsize=6)
            if r == gh - 1:
                ax.set_xlabel(str(c + 1), fontsize=6)
    fig.colorbar(im, ax=axes, fraction=0.03, label="cosine similarity")
    fig.suptitle(title or "Position embedding similarity", fontsize=9)
    return _save(fig, path)


def save_attention_distance(dist: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Mean attention distance (depth, heads) as points per head against depth."""
    plt = _plt()
    depth, heads = dist.shape
    fig, ax = plt.subplots(figsize=(4.5, 3.6))
    for h in range(heads):
        ax.scatter(np.arange(depth), dist[:, h].numpy(), s=12, label=f"head {h + 1}")
    ax.set_xticks(range(depth))
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_ylim(bottom=0)
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2)
    ax.set_title(title or "Mean attention distance per head", fontsize=9)
    return _save(fig, path)
