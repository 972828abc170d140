"""Token dropping (`patch_drop_rate`): timm's own folders (tests/fixtures/patch_dropout, made by
make_patch_dropout.py) read by vitkit to timm's logits in evaluation and, with the same seed, in training; what the
blocks see; the options it cannot go with."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.errors import UsageError

FIXTURES = Path(__file__).parent / "fixtures" / "patch_dropout"


@pytest.mark.parametrize("name", ["token_reg", "avg"])
def test_matches_timm_in_training_and_evaluation(name):
    """timm's name built with the folder's model_args (as a timm user passes them), and the folder read by
    `vitkit.load` (which, as for drop_path_rate, takes no training regularisation from a file: it is passed as an
    override), holding the same weights: timm's logits in evaluation, and in training after the same seed."""
    folder = FIXTURES / name
    args = json.loads((folder / "config.json").read_text())["model_args"]
    assert vitkit.load(folder).config.patch_drop_rate == 0.0
    loaded = vitkit.load(folder, patch_drop_rate=args["patch_drop_rate"])
    built = vitkit.create_model("vit_base_patch16_224", **args)
    built.load_state_dict(loaded.state_dict(), strict=True)
    x = torch.from_numpy(np.load(folder / "input.npy"))
    for model in (loaded, built):
        assert model.config.patch_drop_rate == args["patch_drop_rate"]
        with torch.no_grad():
            model.eval()
            assert (model(x) - torch.from_numpy(np.load(folder / "logits_eval.npy"))).abs().max() <= 1e-4
            model.train()
            outs = []
            for s in (0, 1):
                torch.manual_seed(s)
                outs.append(model(x))
                assert (outs[-1] - torch.from_numpy(np.load(folder / f"logits_train_{s}.npy"))).abs().max() <= 1e-4
        assert (outs[0] - outs[1]).abs().max() > 1e-3  # the seeds keep different tokens


def test_blocks_see_a_random_subset_and_every_prefix_token():
    torch.manual_seed(0)
    model = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, num_classes=3, reg_tokens=1, patch_drop_rate=0.75)
    x = torch.randn(4, 3, 32, 32)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
    tokens = model.embed(x)  # (4, 2 + 16, D)
    model.train()
    model(x)
    kept = seen[-1]
    assert kept.shape == (4, 2 + 4, tokens.shape[-1])  # int(16 * 0.25) patch tokens a row
    assert torch.equal(kept[:, :2], tokens[:, :2])  # the class token and the register
    for b in range(4):  # each kept token is one of its own image's patch tokens, none twice
        match = (kept[b, 2:, None] == tokens[b, None, 2:]).all(-1)  # (4, 16)
        assert (match.sum(1) == 1).all() and match.any(0).sum() == 4
    model.eval()
    model(x)
    assert seen[-1].shape == tokens.shape  # none dropped in evaluation


def test_hybrid_trains():
    model = vitkit.create_model("r26_vit_s32", img_size=28, in_chans=1, num_classes=10, hybrid_layers=(4,),
                                patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64, classifier="gap",
                                patch_drop_rate=0.5).train()
    loss = model(torch.randn(3, 1, 28, 28)).logsumexp(1).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_keeps_the_count_rounded_down():
    model = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, num_classes=3, patch_drop_rate=0.4).train()
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda mod, a: seen.append(a[0].shape[1]))
    model(torch.randn(2, 3, 32, 32))
    assert seen == [1 + 9]  # int(16 * 0.6) = 9 of 16 patch tokens (rounding would keep 10), and the class token


@pytest.mark.parametrize("kw", [dict(patch_drop_rate=1.0), dict(patch_drop_rate=-0.1),
                                dict(patch_drop_rate=0.5, rope="axial"),
                                dict(patch_drop_rate=0.5, pos_embed="relative"),
                                dict(patch_drop_rate=0.5, pos_embed="relative_mlp")])
def test_refused(kw):
    with pytest.raises(UsageError, match="patch_drop_rate"):
        vitkit.create_model("vit_ti16", img_size=32, patch_size=8, **kw)


def test_not_where_every_token_counts(tmp_path):
    """Masked patch prediction, packed batches and a torch.fx trace in training refuse it; a checkpoint of a model
    that carries both an mpp head and the rate loads (to fine-tune without the head), and the registry still names
    the architecture."""
    from vitkit.models.registry import name_of

    assert name_of(vitkit.create_model("vit_ti16", num_classes=3, patch_drop_rate=0.5).config) == "vit_ti16"
    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, num_classes=3, patch_drop_rate=0.5)
    with pytest.raises(UsageError, match="patch_drop_rate"):
        m.add_mpp()
    m.train()
    with pytest.raises(UsageError, match="patch_drop_rate"):
        m([torch.randn(3, 32, 32), torch.randn(3, 16, 32)])  # a packed batch of two sizes
    with pytest.raises(UsageError, match="evaluation mode"):
        torch.fx.symbolic_trace(m)
    torch.fx.symbolic_trace(m.eval())  # no token dropped there: it traces
    both = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, mpp=True, patch_drop_rate=0.5).train()
    x = torch.rand(2, 3, 32, 32)
    with pytest.raises(UsageError, match="patch_drop_rate"):
        both.forward_mpp(x, x)
    vitkit.save(both, tmp_path / "mpp.safetensors")
    back = vitkit.load(tmp_path / "mpp.safetensors")
    assert back.config.mpp and back.config.patch_drop_rate == 0.5
