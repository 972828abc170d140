"""The learned embeddings of Fig. 7: principal components of the patch-embedding filters (left) and the
cosine similarity between position embeddings (centre)."""
from __future__ import annotations

import torch
from torch import nn
from ..errors import UsageError


def embedding_filters(model: nn.Module) -> torch.Tensor:
    """(D, C, P, P) filters that see the pixels: the patch embedding's conv, for a hybrid the ResNet stem's, for a
    convolutional stem (MobileCLIP's) its first conv's."""
    if not hasattr(model, "patch_embed"):
        raise UsageError(f"{type(model).__name__} has no patch embedding: this analysis needs a ViT or a hybrid")
    bb = model.patch_embed.backbone
    if bb is None:
        w = model.patch_embed.proj.weight
    elif hasattr(bb, "stem"):
        w = bb.stem.conv.standardized_weight()
    else:  # ConvStem: conv + BatchNorm + GELU layers
        w = bb[0].conv.weight
    return w.detach().float().cpu()


def filter_principal_components(filters: torch.Tensor, k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """PCA of a filter bank (D, C, P, P): the top-k components as (k, C, P, P) and their explained variance ratios."""
    d = filters.shape[0]
    flat = filters.reshape(d, -1).double()
    flat = flat - flat.mean(0, keepdim=True)
    _, s, vh = torch.linalg.svd(flat, full_matrices=False)
    k = min(k, vh.shape[0])
    var = s**2
    return vh[:k].reshape(k, *filters.shape[1:]).float(), (var[:k] / var.sum()).float()


def position_embedding_grid(model: nn.Module) -> torch.Tensor:
    """(gh * gw, D): the position embedding of each patch (class token excluded)."""
    pe = getattr(model, "pos_embed", None)
    if pe is None or not hasattr(pe, "grid"):
        raise UsageError("this model has no absolute position embedding (pos_embed 'none' or 'relative')")
    return pe.grid().detach().float().cpu()


def position_similarity(model_or_grid: nn.Module | torch.Tensor, grid_size: tuple[int, int] | None = None) -> torch.Tensor:
    """(gh, gw, gh, gw): cosine similarity of each patch's position embedding with every other's."""
    if isinstance(model_or_grid, nn.Module):
        grid_size = model_or_grid.config.grid_size
        emb = position_embedding_grid(model_or_grid)
    else:
        emb = model_or_grid
    e = torch.nn.functional.normalize(emb.double(), dim=-1)
    sim = e @ e.t()  # (N, N)
    return sim.reshape(*grid_size, *grid_size).float()
