"""Packed batches: images of different sizes and aspect ratios in one forward (NaViT, SigLIP 2's NaFlex).

A row of patches per image (`layers/packing.py`), each image with its own resampled position grid, attention masked
to its own tokens and pooled alone. `PackedForward` is the part of `VisionTransformer` that does it; the encoder is
the model's own (`_encode`), run with the key mask and the per-token rotary angles.
"""
from __future__ import annotations

import torch

from .layers.packing import PackedBatch, as_packed, grid_sizes, key_mask, masked_mean
from ..errors import UsageError


class PackedForward:
    """`VisionTransformer`'s methods for a packed batch (the model has `config`, `patch_embed`, `pos_embed`, the
    prefix tokens, `pos_drop`, `norm_pre`, `rope`, `_encode`, `norm`, `attn_pool`, `fc_norm` and the head)."""

    def _check_packable(self) -> None:
        c = self.config
        if c.hybrid_layers is not None or getattr(c, "conv_stem", None):
            raise UsageError("a hybrid's ResNet (or a conv stem) reads whole images: packed batches of patches are for plain ViTs "
                             "(run a hybrid on one size per batch, or one image at a time)")
        if c.pos_embed in ("relative", "relative_mlp"):
            raise UsageError("packed batches need an absolute position embedding, not the relative bias")

    def embed_packed(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """A packed batch -> (the encoder's input (B, p + L, D), the attention mask (B, 1, 1, p + L), the rotary
        embedding's (sin, cos) per token or None). Each image's patches get the position grid resampled to that
        image's grid (`config.pos_resample`, per token: `packing.resample_for_coords`)."""
        self._check_packable()
        c, p = self.config, self.config.num_prefix_tokens
        x = self.patch_embed.embed_patches(batch.patches)  # (B, L, D)
        sizes = grid_sizes(batch.coords, batch.valid)  # (B, 2): every image's grid
        pe = self.pos_embed.for_coords(batch.coords, sizes, c.pos_resample, c.pos_resample_square)  # (B, L, D)
        if pe is not None:
            x = x + pe.to(x.dtype)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if prefix:
            pre = torch.cat(prefix, dim=1)  # (B, p, D)
            pos = None if c.no_embed_class else self.pos_embed.prefix_embed()
            x = torch.cat([pre if pos is None else pre + pos, x], dim=1)  # (B, p, D) + (B, L, D) -> (B, p + L, D)
        x = self.norm_pre(self.pos_drop(x))
        if self.lowp_stream and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        rope = self.rope.for_coords(batch.coords, sizes) if self.rope is not None else None
        return x, key_mask(batch.valid, p), rope

    def forward_features_packed(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed batch (or a list of images) -> (all tokens after the final norm (B, p + L, D), valid (B, L))."""
        batch = as_packed(x, self.config.patch_size)
        h, mask, rope = self.embed_packed(batch)
        return self.norm(self._encode(h, rope=rope, mask=mask)[0]), batch.valid

    def pool_packed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`pool` per image of a packed batch: the class token, the mean of the image's own patches, or the
        attention pooling over them."""
        p = self.config.num_prefix_tokens
        if self.config.classifier == "token":
            return x[:, 0]
        if self.attn_pool is not None and self.config.pool_prefix:  # the prefix tokens are valid in every row
            return self.attn_pool(x, valid=torch.cat([valid.new_ones(valid.shape[0], p), valid], dim=1))
        if self.attn_pool is not None:
            return self.attn_pool(x[:, p:], valid=valid)
        return self.fc_norm(masked_mean(x[:, p:], valid))

    def forward_head_packed(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`forward_head` for a packed batch: tokens (B, p + L, D), valid (B, L) -> logits (B, K)."""
        if self.config.classifier == "token":  # the class token (and DeiT's distillation token): no padding to skip
            return self.forward_head(x)
        return self.head(self.head_drop(self.pre_logits(self.pool_packed(x, valid))))

    def forward_packed(self, x) -> torch.Tensor:
        """Images of different sizes in one forward: a PackedBatch (or a list of (C, H, W) images, or timm's NaFlex
        dict) -> logits (B, num_classes), one row per image, each as the image alone would give."""
        batch = as_packed(x, self.config.patch_size)
        if not self._cls_only_last_block():
            return self.forward_head_packed(*self.forward_features_packed(batch))
        h, mask, rope = self.embed_packed(batch)
        h = self._encode(h, rope=rope, mask=mask, cls_only_last=True)[0]  # (B, p, D): the prefix tokens alone
        return self.forward_head(self.norm(h))
