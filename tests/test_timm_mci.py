"""MobileCLIP's MCi image encoder (timm's `vit_base_mci_224`, issue 53): a ViT-B on a convolutional stem (conv 4x4/4 +
BatchNorm + GELU, conv 2x2/2 + BatchNorm + GELU, the 2x2/2 patch embedding with a bias: vitkit's `conv_stem`). timm's
own files at two small widths, one at a non-square input (tests/fixtures/timm_mci, `make_registry_sweep.py mci`): the
folders and their bare state dicts load and give timm's logits (<= 1e-4, fp32) in eval mode (BatchNorm's running
statistics), in train mode (the batch's) and resized to another grid; timm's name builds timm's parameter count; vitkit's timm export is timm's
file, tensor for tensor (BatchNorm's batch count too), and timm reads it to its own logits."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitkit
from vitkit.checkpoints.io import CheckpointError, read_safetensors
from vitkit.errors import UsageError
from vitkit.models import ViTConfig, build_model
from vitkit.models.layers import ConvStem

FIX = Path(__file__).parent / "fixtures" / "timm_mci"
CASES = json.loads((FIX / "index.json").read_text())["cases"]
TOL = 1e-4
# timm 1.0.31 counts vit_base_mci_224's parameters (tests/fixtures/make_registry_sweep.py archs: timm_archs.json):
# with its 512-wide head (MobileCLIP's image embedding) and with none
MCI_PARAMS, MCI_PARAMS_0 = 86_349_056, 85_955_328


def _input(case: str) -> torch.Tensor:
    return torch.from_numpy(np.load(FIX / case / "input.npy"))


def _worst(model, case: str, expected: str = "logits") -> float:
    with torch.no_grad():
        out = model(_input(case)).numpy()
    return float(np.abs(out - np.load(FIX / case / f"{expected}.npy")).max())


def _stem(case: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(vitkit's conv_stem, conv_stem_kernels) of a case: timm's ConvStem but its last conv (the embedding)."""
    stem = CASES[case]["conv_stem"]
    return tuple(stem["channels"][:-1]), tuple(stem["kernels"][:-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timm_mci_folder_gives_timms_logits_in_eval_and_train_mode(case):
    model = vitkit.load(FIX / case)
    c = model.config
    assert (c.conv_stem, c.conv_stem_kernels) == _stem(case) and c.conv_stem_strides == ()
    assert c.stem_strides == c.conv_stem_kernels  # patchify convs
    assert tuple(c.img_size) == tuple(CASES[case]["input"]) and c.no_embed_class and c.hybrid_layers is None
    assert c.patch_size == (16, 16) and not model.training
    assert _worst(model, case) <= TOL
    # train mode: BatchNorm normalises by the batch's statistics (the fixture's running ones are far from them)
    assert _worst(model.train(), case, "logits_train") <= TOL
    assert np.abs(np.load(FIX / case / "logits.npy") - np.load(FIX / case / "logits_train.npy")).max() > 1e-2


@pytest.mark.parametrize("case", sorted(CASES))
def test_at_another_size_the_position_grid_resamples_as_timms(case):
    """timm's `set_input_size` (the stem's feature map at the new size, the position grid resampled by antialiased
    bicubic) against `vitkit.load(folder, img_size=...)`: square to non-square and back."""
    size = tuple(CASES[case]["resized"])
    model = vitkit.load(FIX / case, img_size=size)
    assert model.config.img_size == size and model.config.pos_resample == "bicubic"
    with torch.no_grad():
        out = model(torch.from_numpy(np.load(FIX / case / "input_resized.npy"))).numpy()
    assert np.abs(out - np.load(FIX / case / "logits_resized.npy")).max() <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bare_timm_mci_state_dict_loads_by_its_tensors_and_by_its_name(case):
    """The folder's model.safetensors alone: its stem read from its tensors, the head count and (for the non-square
    grid) the size given, as a timm user gives them to create_model; and named by its architecture."""
    row = CASES[case]
    f = FIX / case / "model.safetensors"
    hints = {"num_heads": row["model_args"]["num_heads"], "img_size": tuple(row["input"])}
    named = vitkit.load(f, architecture="vit_base_mci_224", **hints)
    assert named.config.no_embed_class and named.config.mean == (0.0, 0.0, 0.0)
    assert _worst(named, case) <= TOL
    # without the name, the patches-only position embedding is what the tensors tell (a square grid) or the user says
    square = row["input"][0] == row["input"][1]
    assert _worst(vitkit.load(f, **hints, **({} if square else {"no_embed_class": True})), case) <= TOL


def test_a_state_dict_without_batchnorm_batch_counts_loads(tmp_path):
    """`num_batches_tracked` absent (a writer that drops it): 0, as torch's BatchNorm fills it; the outputs are the
    same (with momentum 0.1 it is a counter only)."""
    from safetensors.torch import save_file

    case = "mci_3x3"
    sd = read_safetensors(FIX / case / "model.safetensors")[0]
    assert sum(k.endswith("num_batches_tracked") for k in sd) == 2
    save_file({k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}, tmp_path / "model.safetensors")
    model = vitkit.load(tmp_path / "model.safetensors", architecture="vit_base_mci_224", num_heads=2)
    assert int(model.patch_embed.backbone[0].bn.num_batches_tracked) == 0
    assert _worst(model, case) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_timms_name_with_the_stem_builds_the_fixture_model(case):
    """`create_model("vit_base_mci_224", **timm's keywords)` with the stem's layers (vitkit's conv_stem: timm takes
    the stem as an embed_layer module) takes timm's weights strictly."""
    row = CASES[case]
    channels, kernels = _stem(case)
    model = vitkit.create_model("vit_base_mci_224", conv_stem=channels, conv_stem_kernels=kernels, **row["model_args"])
    assert sum(p.numel() for p in model.parameters()) == row["params"]
    model.load_state_dict(vitkit.load(FIX / case).state_dict(), strict=True)
    assert _worst(model.eval(), case) <= TOL


def test_vit_base_mci_224_has_timms_parameter_count():
    with torch.device("meta"):
        model = vitkit.create_model("vit_base_mci_224")
        headless = vitkit.create_model("vit_base_mci_224", num_classes=0)
    c = model.config
    assert (c.conv_stem, c.conv_stem_kernels, c.stem_strides, c.patch_size) == ((192, 192), (4, 2), (4, 2), (16, 16))
    assert model.num_classes == 512 and c.no_embed_class and c.mean == (0.0, 0.0, 0.0)
    assert model.pretrained_cfg["first_conv"] == "patch_embed.backbone.0.conv"  # timm's pretrained_cfg
    assert sum(p.numel() for p in model.parameters()) == MCI_PARAMS
    assert sum(p.numel() for p in headless.parameters()) == MCI_PARAMS_0
    # the stem's norms are BatchNorm with running statistics and a batch count (buffers, not parameters)
    names = dict(model.named_buffers())
    assert {"patch_embed.backbone.0.bn.running_mean", "patch_embed.backbone.1.bn.num_batches_tracked"} <= set(names)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_to_timm_writes_timms_file(case, tmp_path):
    """vitkit's timm export of the folder is timm's model.safetensors name for name and value for value (the last
    stem conv back at `patch_embed.backbone.2.conv`, BatchNorm's int64 batch count kept); its config.json names the
    architecture; timm read vitkit's export to its own logits (index.json, when the fixture was made)."""
    row = CASES[case]
    out = vitkit.export(vitkit.load(FIX / case), tmp_path / "export", to="timm")
    ours, theirs = read_safetensors(out / "model.safetensors")[0], read_safetensors(FIX / case / "model.safetensors")[0]
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    assert int(ours["patch_embed.backbone.0.bn.num_batches_tracked"]) == int(
        theirs["patch_embed.backbone.0.bn.num_batches_tracked"]) > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "vit_base_mci_224" and cfg["model_args"]["patch_size"] == [1, 1]
    assert cfg["model_args"]["no_embed_class"] is True
    assert _worst(vitkit.load(out), case) <= TOL
    assert row["export_same_names"] and row["export_max_abs_tensor_diff"] == 0.0
    assert row["timm_reads_vitkit_export"] <= TOL and row["timm_reads_back"] <= TOL


def test_export_refuses_a_conv_stem_timm_cannot_hold(tmp_path):
    """Strides other than the kernels (padded convs): timm's file would read back as patchify convs. A distilled
    model on a conv stem: timm registers none."""
    base = dict(img_size=32, patch_size=16, embed_dim=16, depth=1, num_heads=2, mlp_dim=32, num_classes=3,
                conv_stem=(8, 8), conv_stem_kernels=(3, 4), conv_stem_strides=(2, 4))
    with pytest.raises(CheckpointError, match="conv_stem_strides"):
        vitkit.export(build_model(ViTConfig(**base)), tmp_path / "padded", to="timm")
    distilled = {**base, "conv_stem_kernels": (2, 8), "conv_stem_strides": (), "distilled": True}
    with pytest.raises(CheckpointError, match="vit_base_mci_224"):
        vitkit.export(build_model(ViTConfig(**distilled)), tmp_path / "distilled", to="timm")
    for to, name in (("npz", "m.npz"), ("hf", "hf")):  # no conv stem in the official format or transformers' ViT
        with pytest.raises(CheckpointError, match="convolutional stem"):
            vitkit.export(build_model(ViTConfig(**{**distilled, "distilled": False})), tmp_path / name, to=to)
    # vitkit's own format holds either, BatchNorm's buffers included
    model = build_model(ViTConfig(**base)).eval()
    back = vitkit.load(vitkit.export(model, tmp_path / "own.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert back.config.conv_stem_strides == (2, 4)


def test_conv_stem_config_is_checked():
    base = dict(img_size=32, patch_size=16, embed_dim=16, depth=1, num_heads=2, mlp_dim=32)
    for bad, words in [({"conv_stem": (8,), "conv_stem_kernels": (4, 2)}, "one kernel and one stride"),
                       ({"conv_stem": (8, 8), "conv_stem_kernels": (2, 2), "conv_stem_strides": (4, 2)}, "skip pixels"),
                       ({"conv_stem": (8, 8), "conv_stem_kernels": (4, 8)}, "not a multiple"),
                       ({"conv_stem": (8, 8), "conv_stem_kernels": (2, 8), "conv_stem_strides": (1, 8)}, "even kernel"),
                       ({"conv_stem": (8,), "conv_stem_kernels": (4,), "hybrid_layers": ()}, "hybrid_layers"),
                       ({"conv_stem_kernels": (4,)}, "set conv_stem"),
                       ({"conv_stem": (0,), "conv_stem_kernels": (4,)}, "conv_stem")]:
        with pytest.raises(UsageError, match=words):
            ViTConfig(**base, **bad)
    # a config without a stem writes none of the stem's fields (the previous vitkit reads it)
    assert not {"conv_stem", "conv_stem_kernels", "conv_stem_strides"} & set(ViTConfig(**base).to_dict())
    # strides equal to the kernels are stored as () (patchify), so that new kernels bring their strides along
    mci = ViTConfig(**base, conv_stem=(8, 8), conv_stem_kernels=(4, 2), conv_stem_strides=(4, 2))
    assert mci.conv_stem_strides == () and dataclasses.replace(mci, conv_stem_kernels=(2, 2)).stem_strides == (2, 2)
    padded = ViTConfig(**base, conv_stem=(8,), conv_stem_kernels=(3,), conv_stem_strides=(2,))
    assert ViTConfig.from_dict(padded.to_dict()) == padded
    with torch.no_grad():  # padding (k - s + 1) // 2: each layer divides the size by its stride exactly
        assert build_model(padded).patch_embed.backbone(torch.zeros(1, 3, 32, 32)).shape == (1, 8, 16, 16)
        for k, st in [(2, 2), (3, 2), (4, 2), (5, 2), (3, 1), (5, 1), (6, 4), (7, 4)]:
            stem = ConvStem((4,), (k,), (st,))
            assert stem(torch.zeros(1, 3, 24, 40)).shape == (1, 4, 24 // st, 40 // st), (k, st)


def test_a_conv_stem_model_trains():
    """A few optimiser steps in train mode: the loss is finite and falls, a gradient reaches every parameter (the
    stem's convs and BatchNorm scales too), BatchNorm's running statistics and batch count move; in eval mode the
    model then uses those running statistics (a batch of one gives the same logits alone as beside another image)."""
    torch.manual_seed(0)
    model = vitkit.create_model("vit_base_mci_224", conv_stem=(8, 8), embed_dim=32, depth=2, num_heads=2,
                                img_size=32, num_classes=3)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,))
    bn = model.patch_embed.backbone[0].bn
    mean0 = bn.running_mean.clone()
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if len(losses) == 1:  # (the head starts at zero: the first step's gradient stops there)
            missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not missing, missing
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert int(bn.num_batches_tracked) == 5 and not torch.equal(bn.running_mean, mean0)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(x[:1]), model(x)[:1], atol=1e-5)


def test_counting_flops_leaves_batchnorm_alone():
    """The FLOP probe (run on a model in train mode when a run describes it) runs in eval mode: BatchNorm's running
    statistics and batch count stay as they were, and so does every module's mode."""
    from vitkit.models.stats import count_flops

    model = vitkit.create_model("vit_base_mci_224", conv_stem=(8, 8), embed_dim=32, depth=1, num_heads=2, img_size=32)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert count_flops(model, (32, 32)) > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(m.training for m in model.modules())


def test_a_training_run_on_a_conv_stem_learns(tmp_path):
    """vitkit's trainer on timm's name with a small stem (digits, 16 px, seconds): it learns, and the run's weights
    hold finite running statistics counted over its steps."""
    from vitkit.training import apply_overrides, get_preset, train

    cfg = get_preset("fashion-mnist")
    cfg.model.overrides = {}
    apply_overrides(cfg, {
        "data.dataset": "digits", "data.batch_size": 64, "data.eval_batch_size": 500, "model.name": "vit_base_mci_224",
        "aug.hflip": False, "aug.pad": 0, "run.tta": "none", "optim.lr": 3e-3, "schedule.epochs": 4,
        "schedule.warmup_epochs": 0.5, "run.progress": False, "run.threads": 1, "run.deterministic": True,
        "run.precision": "fp32", "run.out_dir": str(tmp_path / "run"),
        "model.overrides": {"conv_stem": [16, 16], "conv_stem_kernels": [2, 2], "embed_dim": 64, "depth": 2,
                            "num_heads": 4, "mlp_ratio": 2.0, "img_size": 16, "in_chans": 1}})
    res = train(cfg)
    assert res["acc1"] > 0.8, res  # 10 classes: chance is 0.1
    model = vitkit.load(tmp_path / "run" / "final.safetensors")
    bn = model.patch_embed.backbone[0].bn
    assert model.config.conv_stem == (16, 16) and torch.isfinite(bn.running_mean).all()
    assert int(bn.num_batches_tracked) == res["step"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_apples_mobileclip_release_loads_as_timm_converts_it(case):
    """Apple's release layout (`image_encoder.model.*` beside the text tower), which timm's own converter reads to
    exactly timm's state dict (index.json): its image tower loads, the text tower left unused, timm's logits; the
    table written back gives the release's image-tower tensors."""
    from vitkit.checkpoints import layouts, mobileclip
    from vitkit.checkpoints.api import read_checkpoint
    from vitkit.checkpoints.io import read_torch

    row = CASES[case]
    assert row["release_timm_converts_exactly"]
    f = FIX / case / "mobileclip_release.pt"
    hints = {"num_heads": row["model_args"]["num_heads"], "img_size": tuple(row["input"])}
    ck = read_checkpoint(f, **hints)
    assert ck.format == "mobileclip-release" and all(k.startswith(("text_encoder.", "logit_scale")) for k in ck.unused)
    assert len(ck.unused) == 3 and not ck.state_dict["head.bias"].any()
    model = vitkit.load(f, **hints)
    assert model.config.conv_stem == _stem(case)[0] and model.config.mean == (0.0, 0.0, 0.0)
    assert _worst(model, case, "logits_release") <= TOL
    raw = read_torch(f)
    back, left = layouts.write(mobileclip.LAYOUT, ck.state_dict)
    image = {k: v for k, v in raw.items() if k.startswith("image_encoder.")}
    assert not left and sorted(back) == sorted(image) and all(torch.equal(back[k], image[k]) for k in image)


def test_a_release_key_the_table_does_not_know_is_refused(tmp_path):
    from vitkit.checkpoints.io import read_torch

    raw = read_torch(FIX / "mci_3x3" / "mobileclip_release.pt")
    torch.save({**raw, "image_encoder.model.extra_norm.weight": torch.ones(3)}, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match="extra_norm"):
        vitkit.load(tmp_path / "odd.pt", num_heads=2)


def test_a_frozen_stem_keeps_its_batchnorm_statistics():
    """A linear probe or LoRA freezes the stem: in train mode it then normalises by the running statistics it was
    loaded with (timm's logits in eval mode, the fixture's) and never moves them; unfrozen, it follows the batch."""
    case = "mci_3x3"
    model = vitkit.load(FIX / case)
    before = {k: v.clone() for k, v in model.state_dict().items() if ".bn." in k}
    for p in model.patch_embed.backbone.parameters():
        p.requires_grad = False
    model.train()
    assert model.training and model.blocks[0].training and not model.patch_embed.backbone[0].bn.training
    # the blocks train (dropout 0 here), the stem does not: timm's eval-mode logits
    assert _worst(model, case) <= TOL
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if ".bn." in k)
    for p in model.patch_embed.backbone.parameters():
        p.requires_grad = True
    assert _worst(model.train(), case, "logits_train") <= TOL


def _release(tmp_path, name, **changed):
    from vitkit.checkpoints.io import read_torch

    raw = read_torch(FIX / "mci_3x3" / "mobileclip_release.pt")
    raw.update({"image_encoder.model." + k: v(raw["image_encoder.model." + k] if "image_encoder.model." + k in raw
                                              else None) for k, v in changed.items()})
    torch.save(raw, tmp_path / f"{name}.pt")
    return tmp_path / f"{name}.pt"


def test_a_release_of_another_width_does_not_get_timms_twelve_heads():
    """Red team N2: vit_base_mci_224's 12 heads were applied to a 24-wide release (3 heads): wrong logits. At another
    size than timm's architecture the heads are asked for (the tensors cannot tell them)."""
    f = FIX / "mci_2x4" / "mobileclip_release.pt"
    with pytest.raises(CheckpointError, match="width 24 is not a standard size: pass num_heads="):
        vitkit.load(f, img_size=(32, 64))
    assert _worst(vitkit.load(f, img_size=(32, 64), num_heads=3), "mci_2x4", "logits_release") <= TOL


def test_a_release_position_embedding_not_one_by_one_is_refused(tmp_path):
    """Red team N3: a (3, 1, N, D) position embedding was read as its first slice, the rest dropped; the transform
    itself refuses any leading shape but (1, 1)."""
    from vitkit.checkpoints import layouts

    f = _release(tmp_path, "pos", **{"pos_embed.pos_embed.pos_embed": lambda t: torch.cat([t, t, t])})
    with pytest.raises(CheckpointError, match=r"pos_embed.pos_embed.pos_embed has shape \(3, 1, 9, 32\)"):
        vitkit.load(f, num_heads=2)
    read = layouts.TRANSFORMS["lead_one"][0]
    assert read(torch.zeros(1, 1, 4, 8), {}).shape == (1, 4, 8)
    for shape in [(3, 1, 4, 8), (1, 4, 8), (1, 2, 4, 8)]:
        with pytest.raises(CheckpointError, match=rf"position embedding of shape \({', '.join(map(str, shape))}\)"):
            read(torch.zeros(shape), {})


def test_a_stem_batchnorm_with_a_negative_variance_is_refused(tmp_path):
    """Red team N4: running_var < 0 loaded and gave NaN probabilities. Refused by name in the release, in timm's
    names, and in any state dict a conv stem is loaded from (vitkit's own files too)."""
    from vitkit.models.layers.conv_stem import check_batchnorm_stats

    f = _release(tmp_path, "var", **{"patch_emb.0.block.norm.running_var": lambda t: -t})
    with pytest.raises(CheckpointError, match="patch_emb.0.block.norm.running_var has .* negative or non-finite"):
        vitkit.load(f, num_heads=2)
    w, _ = read_safetensors(FIX / "mci_3x3" / "model.safetensors")
    bad = {**w, "patch_embed.backbone.1.bn.running_var": w["patch_embed.backbone.1.bn.running_var"].clone()}
    bad["patch_embed.backbone.1.bn.running_var"][0] = float("nan")
    with pytest.raises(CheckpointError, match="patch_embed.backbone.1.bn.running_var has 1 negative or non-finite"):
        check_batchnorm_stats(bad)
    model = vitkit.load(FIX / "mci_3x3")
    with pytest.raises(CheckpointError, match="backbone.1.bn.running_var has 1 negative"):
        model.load_state_dict({**model.state_dict(), "patch_embed.backbone.1.bn.running_var": bad[
            "patch_embed.backbone.1.bn.running_var"].nan_to_num(-1.0)})
    check_batchnorm_stats(w)  # the fixture's own statistics pass


def test_a_bare_stem_of_overlapping_convs_asks_for_its_strides(tmp_path):
    """Red team N6: timm's default ConvStem (3x3 kernels, stride 2) was read as patchify convs (stride 3: a 27-pixel
    patch), no note. Odd kernels are refused unless conv_stem_strides= says the strides; MCi's 4, 2, 2 still load."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = {}
    for i, (cin, cout) in enumerate([(3, 12), (12, 16)]):
        sd[f"patch_embed.backbone.{i}.conv.weight"] = torch.randn(cout, cin, 3, 3)
        sd.update({f"patch_embed.backbone.{i}.bn.{n}": torch.ones(cout) for n in ("weight", "bias", "running_var")})
        sd[f"patch_embed.backbone.{i}.bn.running_mean"] = torch.zeros(cout)
    sd.update({"patch_embed.backbone.2.conv.weight": torch.randn(24, 16, 3, 3), "patch_embed.backbone.2.conv.bias":
               torch.zeros(24), "pos_embed": torch.zeros(1, 64, 24), "cls_token": torch.zeros(1, 1, 24)})
    for name, shape in [("norm1.weight", (24,)), ("norm1.bias", (24,)), ("attn.qkv.weight", (72, 24)),
                        ("attn.qkv.bias", (72,)), ("attn.proj.weight", (24, 24)), ("attn.proj.bias", (24,)),
                        ("norm2.weight", (24,)), ("norm2.bias", (24,)), ("mlp.fc1.weight", (96, 24)),
                        ("mlp.fc1.bias", (96,)), ("mlp.fc2.weight", (24, 96)), ("mlp.fc2.bias", (24,))]:
        sd[f"blocks.0.{name}"] = torch.randn(shape)
    sd.update({"norm.weight": torch.ones(24), "norm.bias": torch.zeros(24)})
    save_file(sd, str(tmp_path / "convstem.safetensors"))
    with pytest.raises(CheckpointError, match=r"conv stem kernels \(3, 3\) with a 3x3 patch embedding.*pass "
                                              r"conv_stem_strides="):
        vitkit.load(tmp_path / "convstem.safetensors", num_heads=3)
    model = vitkit.load(tmp_path / "convstem.safetensors", num_heads=3, conv_stem_strides=(2, 2))
    assert model.config.stem_strides == (2, 2) and model.config.patch_size == (12, 12)
    for case in CASES:  # MCi's patchify kernels: no strides needed
        row = CASES[case]
        assert _worst(vitkit.load(FIX / case / "model.safetensors", num_heads=row["model_args"]["num_heads"],
                                  img_size=tuple(row["input"]), no_embed_class=True), case) <= TOL


def test_a_release_with_a_malformed_stem_or_projection_is_refused_by_name(tmp_path):
    """Red team W4: an extra patch_emb.3 conv, a 0x0 kernel, a 3-D projection (a KeyError, a ZeroDivisionError, a
    RuntimeError before)."""
    cases = [("extra", {"patch_emb.3.block.conv.weight": lambda t: torch.zeros(32, 32, 1, 1)},
              r"stem layers \[0, 1, 2, 3\] \(image_encoder.model.patch_emb.3.block.conv.weight\)"),
             ("k0", {"patch_emb.1.block.conv.weight": lambda t: torch.zeros(*t.shape[:2], 0, 0)},
              r"patch_emb.1.block.conv.weight has shape \(8, 8, 0, 0\)"),
             ("proj", {"classifier.proj": lambda t: t[None]}, r"classifier.proj has shape \(1, 32, 5\)")]
    for name, changed, words in cases:
        with pytest.raises(CheckpointError, match=words):
            vitkit.load(_release(tmp_path, name, **changed), num_heads=2)


def test_a_conv_stem_model_in_the_other_paths():
    """Review of issue 53: FSDP2's units leave the conv stem to the root (it has no ResNet stages), Fig. 7's filters
    are its first conv's, a packed batch is refused up front by name, LoRA adapts its attention."""
    from vitkit.analysis.embeddings import embedding_filters
    from vitkit.errors import UsageError
    from vitkit.models.lora import apply_lora
    from vitkit.models.registry import build_model
    from vitkit.models.vit_config import ViTConfig
    from vitkit.training.distributed import shard_units

    m = build_model(ViTConfig(img_size=32, patch_size=16, embed_dim=48, depth=2, num_heads=2, mlp_dim=96,
                              conv_stem=(8, 8), conv_stem_kernels=(4, 2)))
    assert shard_units(m) == list(m.blocks)
    assert tuple(embedding_filters(m).shape) == (8, 3, 4, 4)
    with pytest.raises(UsageError, match=r"conv stem\) reads whole images"):
        m([torch.randn(3, 32, 32)])
    assert apply_lora(m, 2) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
