"""Masked patch prediction (Sec. 4.6 and App. B.1.2 of arXiv 2010.11929): the ViT's self-supervised pre-training.

Half of every image's patch embeddings are corrupted (80% of them become a learnable mask embedding, 10% another
patch's embedding from the batch, 10% stay) and the model predicts each corrupted patch's 3-bit mean colour (a class
of 8^C) from its output token. `MaskedPatchPrediction` is the part of `VisionTransformer` that does it
(`forward_mpp`, `add_mpp`, `drop_mpp`); the functions below are its pieces.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import Linear
from ..errors import UsageError


def mpp_corruption(b: int, n: int, ratio: float, g: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which patches masked patch prediction corrupts, and how: (corrupted (B, N) bool: round(ratio * N) per
    image; how (B, N): 0 unchanged, 1 the mask embedding (80% of the corrupted), 2 another patch (10%))."""
    k = max(1, round(ratio * n))
    order = torch.rand(b, n, generator=g, device=device).argsort(1)  # a random permutation per image
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=device).scatter_(1, order[:, :k], True)
    u = torch.rand(b, n, generator=g, device=device)
    how = torch.where(u < 0.8, 1, torch.where(u < 0.9, 2, 0)) * corrupted
    return corrupted, how


def mpp_random_patches(b: int, n: int, g: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random other patch of the batch for every position: (image index, patch index), each (B, N)."""
    flat = torch.randint(0, b * n - 1, (b, n), generator=g, device=device)
    own = torch.arange(b * n, device=device).view(b, n)  # (B * N,) -> (B, N)
    flat = flat + (flat >= own).long()  # never the patch itself
    return flat // n, flat % n


def mpp_targets(pixels: torch.Tensor, patch: tuple[int, int]) -> torch.Tensor:
    """The class of every patch's mean colour at 3 bits a channel: pixels (B, C, H, W) in [0, 1] -> (B, N) codes in
    [0, 8^C), the channels' 3-bit values read as base-8 digits (red most significant)."""
    b, c, h, w = pixels.shape
    ph, pw = patch
    mean = pixels.reshape(b, c, h // ph, ph, w // pw, pw).mean(dim=(3, 5))  # (B, C, gh, ph, gw, pw) -> (B, C, gh, gw)
    bits = (mean * 8).floor().clamp(0, 7).long().flatten(2).transpose(1, 2)  # (B, C, gh, gw) -> (B, N, C)
    weights = 8 ** torch.arange(c - 1, -1, -1, device=pixels.device)
    return (bits * weights).sum(-1)  # (B, N)


def mpp_layers(embed_dim: int, in_chans: int, device=None) -> tuple[nn.Parameter, Linear]:
    """The head's parameters: the learnable mask embedding (1, 1, D) and the Linear to the 8^C colour codes."""
    return (nn.Parameter(torch.zeros(1, 1, embed_dim, device=device)),
            Linear(embed_dim, 8 ** in_chans, device=device))


def check_no_patch_drop(config) -> None:
    """Masked patch prediction corrupts and predicts every patch: it cannot train with patch_drop_rate."""
    if config.patch_drop_rate:
        raise UsageError(f"masked patch prediction predicts every corrupted patch: it does not train with "
                         f"patch_drop_rate={config.patch_drop_rate} (set model.overrides.patch_drop_rate=0)")


class MaskedPatchPrediction:
    """`VisionTransformer`'s masked-patch-prediction methods (the model has `config`, `patch_embed`, `_add_tokens`,
    `rope_for`, `_encode`, `norm`, and with `config.mpp` the `mask_token` and `mpp_head`)."""

    def forward_mpp(self, x: torch.Tensor, pixels: torch.Tensor, g: torch.Generator | None = None,
                    ratio: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked patch prediction: corrupt `ratio` of every image's patch embeddings (80% of them become the
        learnable mask embedding, 10% another patch's embedding from the batch, 10% stay), and predict each
        corrupted patch's 3-bit mean colour (a class of 8^C) from its output token.

        Args:
            x: the model's input (B, C, H, W), normalised. pixels: the same images in [0, 1], for the targets.
        Returns: (logits (M, 8^C), targets (M,)) for the M corrupted patches of the batch."""
        if not self.config.mpp:
            raise UsageError("this model has no masked-patch-prediction head: create it with mpp=True")
        if self.training:
            check_no_patch_drop(self.config)
        tokens = self.patch_embed(x)  # (B, N, D)
        corrupted, how = mpp_corruption(tokens.shape[0], tokens.shape[1], ratio, g, tokens.device)
        b_idx, n_idx = mpp_random_patches(tokens.shape[0], tokens.shape[1], g, tokens.device)
        swapped = tokens[b_idx, n_idx]  # (B, N, D): a random patch of the batch for every position
        tokens = torch.where((how == 1)[..., None], self.mask_token.to(tokens.dtype), tokens)
        tokens = torch.where((how == 2)[..., None], swapped, tokens)
        h = self._add_tokens(tokens, None)  # (B, N, D) -> (B, p + N, D)
        h = self._encode(h, rope=self.rope_for(x))[0]
        out = self.norm(h)[:, self.config.num_prefix_tokens:]  # (B, p + N, D) -> (B, N, D)
        return self.mpp_head(out[corrupted]), mpp_targets(pixels, self.config.patch_size)[corrupted]

    def add_mpp(self) -> None:
        """Add a fresh masked-patch-prediction head (pre-training a loaded checkpoint further)."""
        check_no_patch_drop(self.config)
        if not self.config.mpp:
            self.config.mpp = True
            self.mask_token, self.mpp_head = mpp_layers(self.config.embed_dim, self.config.in_chans,
                                                        self.patch_embed.proj.weight.device)

    def drop_mpp(self) -> None:
        """Remove the masked-patch-prediction head (after pre-training, for fine-tuning)."""
        if self.config.mpp:
            del self.mask_token, self.mpp_head
            self.config.mpp = False
