"""Muon (`optim.name=muon`): its matrix half against torch's own `torch.optim.Muon`, its AdamW half against
`torch.optim.AdamW`, which parameters each half takes, and a run that trains and resumes exactly."""
import copy

import pytest
import torch
from safetensors.torch import load_file

import vitkit
from vitkit.errors import UsageError
from vitkit.training import get_preset, train
from vitkit.training.checkpoint import config_differences
from vitkit.training.config import OptimConfig
from vitkit.training.muon import Muon, orthogonalize
from vitkit.training.optim import build_optimizer, muon_names

from test_training import tiny_cfg


def _steps(pairs, n=6, seed=0):
    """n steps of each (module, optimizer) pair on the same random squared outputs."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, pairs[0][0].in_features, generator=g)
        for mod, opt in pairs:
            opt.zero_grad()
            mod(x).pow(2).mean().backward()
            opt.step()


def _muon_vs_torch(shape, nesterov, ref_nesterov):
    """The relative distance between vitkit's Muon and torch.optim.Muon (Moonshot's RMS matching) after 6 steps."""
    torch.manual_seed(0)
    ours = torch.nn.Linear(shape[1], shape[0], bias=False)
    ref, start = copy.deepcopy(ours), ours.weight.detach().clone()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
    _steps([(ours, Muon([{"params": [ours.weight], "muon": True}], nesterov=nesterov, **kw)),
            (ref, torch.optim.Muon([ref.weight], adjust_lr_fn="match_rms_adamw", nesterov=ref_nesterov, **kw))])
    with torch.no_grad():
        return float((ours.weight - ref.weight).norm() / (ref.weight - start).norm())


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_matrix_half_is_torchs_muon(shape, nesterov):
    """torch.optim.Muon with Moonshot's RMS matching is the reference (a peer implementation): same momentum,
    Newton-Schulz iteration, step scale and decoupled weight decay. torch iterates in bf16, vitkit in fp32: the
    weights' paths agree to ~2% of their length; the other momentum (or a step 5% off) is 5-10% away."""
    assert _muon_vs_torch(shape, nesterov, nesterov) < 0.03
    assert _muon_vs_torch(shape, nesterov, not nesterov) > 0.05  # the comparison can tell them apart


def test_a_conv_kernel_is_orthogonalised_as_the_matrix_it_multiplies():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 12, 3, bias=False)
    flat = torch.nn.Linear(8 * 9, 12, bias=False)
    with torch.no_grad():
        flat.weight.copy_(conv.weight.reshape(12, -1))
    start = flat.weight.detach().clone()
    o1 = Muon([{"params": [conv.weight], "muon": True}], lr=0.01, weight_decay=0.05)
    o2 = torch.optim.Muon([flat.weight], lr=0.01, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 8, 3, 3, generator=g)  # full rank: bf16 noise in a null space would be amplified
        for mod, opt, inp in ((conv, o1, x), (flat, o2, x.reshape(32, -1))):
            opt.zero_grad()
            mod(inp).pow(2).mean().backward()
            opt.step()
    torch.testing.assert_close(conv.weight.reshape(12, -1), flat.weight, rtol=0, atol=0.01)  # bf16 vs fp32
    assert (conv.weight.reshape(12, -1) - flat.weight).norm() < 0.03 * (flat.weight - start).norm()


def test_the_rest_is_torchs_adamw():
    torch.manual_seed(0)
    ours = torch.nn.Linear(6, 5)
    ref = copy.deepcopy(ours)
    _steps([(ours, Muon(ours.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))),
            (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95)))], n=8)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_newton_schulz_lands_near_the_polar_factor():
    for shape in [(64, 576), (576, 64), (32, 32)]:
        s = torch.linalg.svdvals(orthogonalize(torch.randn(shape)))
        assert 0.6 < float(s.min()) and float(s.max()) < 1.25, (shape, s.min(), s.max())


def test_muon_takes_the_hidden_matrices_and_leaves_the_input_layer_head_and_embeddings_to_adamw():
    m = vitkit.create_model("r26_vit_s32", hybrid_layers=(2,), patch_size=4, embed_dim=64, depth=2, num_heads=2,
                            mlp_dim=128, img_size=28, in_chans=1, num_classes=10, classifier="token")
    names = muon_names(m)
    assert "patch_embed.backbone.stem.conv.weight" not in names  # the input layer
    assert not {"head.weight", "cls_token", "pos_embed.weight"} & names
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "patch_embed.proj.weight",
            "patch_embed.backbone.stages.0.blocks.1.conv2.weight"} <= names
    assert all(p.ndim >= 2 for n, p in m.named_parameters() if n in names)
    opt = build_optimizer(m, OptimConfig(name="muon", lr=1e-3, weight_decay=0.05))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(m.parameters()))
    assert all(g["weight_decay"] == 0.05 for g in opt.param_groups if g["muon"])
    plain = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    assert "patch_embed.proj.weight" not in muon_names(plain) and "blocks.0.attn.qkv.weight" in muon_names(plain)


def test_a_muon_run_learns_and_resumes_to_identical_weights(tmp_path):
    extra = {"optim.name": "muon", "optim.lr": 1e-2, "schedule.epochs": 4, "run.ckpt_every": 10}
    whole = train(tiny_cfg(tmp_path / "whole", **extra))
    assert whole["acc1"] > 0.85, whole  # digits, 10 classes
    train(tiny_cfg(tmp_path / "cut", **extra), max_steps=30)  # stops at a checkpoint mid-run
    resumed = train(tiny_cfg(tmp_path / "cut", **extra))
    assert resumed["step"] == whole["step"]
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(tmp_path / "cut" / "final.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_outputs_of_masked_patch_prediction_and_foreign_models_are_not_muons():
    m = vitkit.create_model("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    m.add_mpp()
    assert "mpp_head.weight" not in muon_names(m) and "blocks.0.mlp.fc1.weight" in muon_names(m)
    with pytest.raises(UsageError, match="input layer and classifier"):
        muon_names(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(7200, 10)))


def test_bad_arguments_and_vectors_are_refused():
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="matrices"):
        Muon([{"params": [b], "muon": True}])
    opt = Muon([{"params": [w], "muon": True}])
    with pytest.raises(ValueError, match="matrices"):
        opt.add_param_group({"params": [b], "muon": True})
    for kw in ({"ns_steps": 0}, {"ns_steps": 2.5}, {"momentum": 1.0}, {"betas": (1.0, 0.999)}, {"eps": 0.0}):
        with pytest.raises(ValueError):
            Muon([w], **kw)


def test_a_bf16_parameter_resumes_with_its_fp32_momentum():
    """load_state_dict casts state to each parameter's dtype: the momentum comes back to fp32, unrounded steps."""
    lin = torch.nn.Linear(8, 8, bias=False).bfloat16()
    opt = Muon([{"params": [lin.weight], "muon": True}], lr=1e-2)
    for _ in range(2):
        lin.weight.grad = torch.randn(8, 8).bfloat16()
        opt.step()
    opt.load_state_dict(opt.state_dict())
    lin.weight.grad = torch.randn(8, 8).bfloat16()
    opt.step()
    assert opt.state[lin.weight]["momentum_buffer"].dtype == torch.float32


def test_a_run_saved_before_the_option_existed_resumes_without_force():
    """config.yaml of an earlier vitkit lacks optim.muon_momentum: its default is what that run had."""
    now = get_preset("fashion-mnist").to_dict()
    before = copy.deepcopy(now)
    del before["optim"]["muon_momentum"]
    assert config_differences(before, now) == []
    now["optim"]["muon_momentum"] = 0.9
    assert config_differences(before, now) == ["optim.muon_momentum: 0.95 -> 0.9"]
