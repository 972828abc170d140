"""LoRA (`vitkit.models.lora`, `model.lora=RANK` in training): the adapters start as the base model, merge into plain
weights equal to the adapter model's outputs on every family, leave the rows they do not target alone, train alone
with the head, resume exactly, and leave plain files behind (the run's weights, its step folders, exports)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import vitkit
from vitkit.checkpoints import export as export_checkpoint
from vitkit.cli import main
from vitkit.errors import UsageError
from vitkit.inference.export import export_model
from vitkit.models.registry import build_config, build_model
from vitkit.models.lora import LoRALinear, apply_lora, lora_layers, mark_only_lora_trainable, merge_lora
from vitkit.training import train

from conftest import tiny_kwargs
from test_training import tiny_cfg

VIT = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
# every family vitkit builds, at test size: the paper's ViT and its hybrid, the later ViTs' options (EVA-02's own
# q/v biases, SwiGLU and rotary embeddings; SigLIP's attention pooling; DINOv2's registers and LayerScale; qk-norm,
# RMSNorm and projections without biases), Swin
FAMILIES = {
    "vit": ("vit_ti16", VIT),
    "hybrid": ("r_vit_ti16", dict(VIT, img_size=32, hybrid_width=0.5)),
    "eva02": ("vit_ti16", dict(VIT, k_bias=False, mlp_layer="swiglu", mlp_norm=True, rope="eva", classifier="gap",
                               fc_norm=True)),
    "siglip": ("vit_ti16", dict(VIT, classifier="map")),
    "dinov2": ("vit_ti16", dict(VIT, reg_tokens=2, init_values=1e-2, mlp_layer="swiglu")),
    "modern": ("vit_ti16", dict(VIT, qk_norm=True, norm="rmsnorm", proj_bias=False, qkv_bias=False, rope="dinov3",
                                rope_half=True)),
    "swin": ("swin_t", dict(img_size=32, patch_size=2, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4)),
}


def _model(family: str, num_classes: int = 0):
    name, kw = FAMILIES[family]
    return build_model(build_config(name, num_classes=num_classes, **kw)).eval()


def _x(model, n: int = 2) -> torch.Tensor:
    c = model.config
    return torch.randn(n, c.in_chans, *c.img_size, generator=torch.Generator().manual_seed(1))


def _randomise_b(model) -> None:
    """B away from its zero start, as training moves it, so that the adapters change the outputs."""
    g = torch.Generator().manual_seed(2)
    for m in lora_layers(model).values():
        with torch.no_grad():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_start_as_the_base_and_merge_to_the_same_outputs(family):
    base = _model(family)
    x = _x(base)
    with torch.no_grad():
        ref = base(x)
        m = copy.deepcopy(base)
        adapted = apply_lora(m, 4, targets=["qkv", "proj", "mlp"])
        assert torch.equal(m(x), ref)  # B = 0: the base model, bitwise
        _randomise_b(m)
        y = m(x)
        assert (y - ref).abs().max() > 1e-3  # the adapters do act, on every path the family takes
        merged = merge_lora(copy.deepcopy(m))
        assert (merged(x) - y).abs().max() <= 1e-5
    assert len(adapted) >= 2 * (2 if family != "swin" else 4)
    assert not lora_layers(merged) and merged.state_dict().keys() == base.state_dict().keys()
    assert all(type(mod) is not LoRALinear for mod in merged.modules())


def test_targets_pick_the_projections_and_qv_leave_the_key_rows_alone():
    base = _model("siglip")
    d = base.config.embed_dim
    names = {t: apply_lora(copy.deepcopy(base), 2, targets=t) for t in ("qkv", "proj", "mlp")}
    assert names["qkv"] == ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "attn_pool.q", "attn_pool.kv"]
    assert names["proj"] == ["blocks.0.attn.proj", "blocks.1.attn.proj", "attn_pool.proj"]
    assert names["mlp"] == [f"blocks.{i}.mlp.fc{j}" for i in (0, 1) for j in (1, 2)] + ["attn_pool.mlp.fc1", "attn_pool.mlp.fc2"]
    m = copy.deepcopy(base)
    apply_lora(m, 2, targets="q,v")  # the LoRA paper's choice, as a comma-separated string too
    qkv = m.blocks[0].attn.qkv
    assert qkv.lora_A.shape == (2 * 2, d) and qkv.lora_B.shape == (2 * d, 2)  # separate A and B for q and for v
    assert m.attn_pool.kv.slices == (1,) and m.attn_pool.q.slices is None  # the pool's fused kv: its v rows
    _randomise_b(m)
    merge_lora(m)
    w0, w1 = base.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight
    assert torch.equal(w0[d:2 * d], w1[d:2 * d])  # the key rows: bitwise unchanged
    assert not torch.equal(w0[:d], w1[:d]) and not torch.equal(w0[2 * d:], w1[2 * d:])
    assert torch.equal(base.attn_pool.kv.weight[:d], m.attn_pool.kv.weight[:d])
    assert torch.equal(base.blocks[0].attn.proj.weight, m.blocks[0].attn.proj.weight)


def test_bad_adapters_are_refused():
    m = _model("vit")
    for kwargs, says in [(dict(rank=0), "positive integer"), (dict(rank=-2), "positive integer"),
                         (dict(rank=2, targets=["query"]), "unknown LoRA target 'query'"),
                         (dict(rank=2, targets=["qkv", "q"]), "qkv adapts the fused projection whole"),
                         (dict(rank=2, targets=[]), "no LoRA target"), (dict(rank=2, alpha=0.0), "alpha"),
                         (dict(rank=2, dropout=1.0), "dropout"), (dict(rank=33), "exceeds blocks.0.attn.qkv")]:
        with pytest.raises(UsageError, match=says):
            apply_lora(copy.deepcopy(m), **kwargs)
    with pytest.raises(UsageError, match="not a CNN"):
        apply_lora(build_model(build_config("bit_r50x1", **tiny_kwargs("bit_r50x1"))), 2)
    apply_lora(m, 2)
    with pytest.raises(UsageError, match="already has LoRA"):
        apply_lora(m, 2)


def test_only_adapters_and_head_train_and_a_step_changes_only_them():
    m = _model("vit", num_classes=3).train()
    apply_lora(m, 2, targets=["q", "v", "mlp"])
    n = mark_only_lora_trainable(m, keep=("head.",))
    trained = {k for k, p in m.named_parameters() if p.requires_grad}
    assert trained == {k for k in m.state_dict() if k.endswith((".lora_A", ".lora_B")) or k.startswith("head.")}
    assert n == sum(p.numel() for p in m.parameters() if p.requires_grad)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    x, y = _x(m, 4), torch.tensor([0, 1, 2, 0])
    for _ in range(3):  # the zero head passes no gradient back at first: the head moves, then B, then A
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert {k for k, v in m.state_dict().items() if not torch.equal(v, before[k])} == trained
    assert m.blocks[0].attn.qkv.weight.grad is None  # a frozen weight gets no gradient at all


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """A small "upstream" ViT for digits' 16x16 grey images with a 5-class head, which fine-tuning replaces."""
    torch.manual_seed(3)
    m = vitkit.create_model("vit_ti16", num_classes=5, in_chans=1, mean=(0.5,), std=(0.5,), **VIT, class_names=list("abcde"))
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    vitkit.save(m, path)
    return path


def _lora_cfg(out, base, **extra):
    return tiny_cfg(out, **{"model.checkpoint": str(base), "model.lora": 4, "model.lora_targets": ["q", "v"],
                            "schedule.epochs": 0.25, "schedule.warmup_epochs": 0.0, "run.eval_every": 0, **extra})


def test_a_lora_run_trains_adapters_and_head_and_writes_plain_files(tmp_path, base_ckpt):
    out = tmp_path / "run"
    res = train(_lora_cfg(out, base_ckpt, **{"run.ema": 0.5}), max_steps=3)
    assert res["step"] == 3
    base, final = load_file(base_ckpt), load_file(out / "final.safetensors")
    assert final.keys() == base.keys() and not any("lora" in k for k in final)  # a plain checkpoint
    d = VIT["embed_dim"]
    for k, v in final.items():
        if k.startswith("head."):
            assert v.shape[0] == 10 and v.abs().sum() > 0  # the new head for digits' classes trained
        elif k.endswith("attn.qkv.weight"):  # q and v rows adapted and merged in; the key rows as they were
            assert torch.equal(v[d:2 * d], base[k][d:2 * d])
            assert not torch.equal(v[:d], base[k][:d]) and not torch.equal(v[2 * d:], base[k][2 * d:])
        else:
            assert torch.equal(v, base[k]), k  # everything else frozen
    # every reader sees a plain model: vitkit (strict), the step folder (its merged entry), vitkit's timm export
    m = vitkit.load(out / "final.safetensors")
    step = vitkit.load(out / "checkpoints" / "step-00000003")
    x = _x(m, 3)
    with torch.no_grad():
        assert torch.equal(step.state_dict()["blocks.0.attn.qkv.weight"], m.state_dict()["blocks.0.attn.qkv.weight"])
        export_checkpoint(m, tmp_path / "timm", to="timm")
        back = vitkit.load(tmp_path / "timm")
        assert (back(x) - m(x)).abs().max() <= 1e-5
    saved = json.loads((out / "checkpoints" / "step-00000003" / "meta.json").read_text())
    assert saved["config"]["model"]["lora"] == 4 and "lora" not in json.dumps(saved["model_config"])


def test_export_merges_the_adapters_and_matches_the_adapter_model(tmp_path):
    m = _model("eva02", num_classes=4)
    apply_lora(m, 2, targets=["qkv", "proj", "mlp"])
    _randomise_b(m)
    torch.nn.init.normal_(m.head.weight, std=0.5)
    report = export_model(m, tmp_path / "m.pt2", "torch-export", dynamic_batch=True)
    assert report.worst <= 1e-5  # against the adapter model itself, adapters unmerged
    program = torch.export.load(str(tmp_path / "m.pt2"))
    assert not any("lora" in k for k in program.state_dict)
    assert lora_layers(m)  # the model exported is left as it was


def test_a_lora_run_resumes_exactly(tmp_path, base_ckpt):
    extra = {"model.lora_dropout": 0.1, "model.lora_targets": ["qkv", "mlp"], "model.lora_alpha": 8.0,
             "run.accumulate": 2, "run.ckpt_every": 2, "schedule.epochs": 0.5}
    whole = train(_lora_cfg(tmp_path / "whole", base_ckpt, **extra))
    part = train(_lora_cfg(tmp_path / "part", base_ckpt, **extra), max_steps=3)
    assert part["step"] == 3 and whole["step"] > 3
    resumed = train(_lora_cfg(tmp_path / "part", base_ckpt, **extra))
    assert resumed["step"] == whole["step"]
    a, b = load_file(tmp_path / "whole" / "final.safetensors"), load_file(tmp_path / "part" / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a run that changes the adapters is another run: resuming it is refused, as for any change to what a step means
    with pytest.raises(Exception, match="model.lora: 4 -> 8"):
        train(_lora_cfg(tmp_path / "part", base_ckpt, **{**extra, "model.lora": 8}))


def test_lora_in_bf16_with_the_low_precision_stream(tmp_path, base_ckpt):
    res = train(_lora_cfg(tmp_path / "bf16", base_ckpt, **{"run.precision": "bf16", "run.lowp_stream": True,
                                                           "model.lora_targets": ["qkv", "proj", "mlp"]}), max_steps=2)
    assert res["step"] == 2
    assert not any("lora" in k for k in load_file(tmp_path / "bf16" / "final.safetensors"))


def test_targets_given_as_a_string_are_the_same_config(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"model.lora": 8, "model.lora_targets": "q, v"})
    assert cfg.model.lora_targets == ["q", "v"]  # as config.yaml records it: a resume with either spelling matches
    assert tiny_cfg(tmp_path, **{"model.lora_targets": "[qkv,mlp]"}).model.lora_targets == ["qkv", "mlp"]


@pytest.mark.parametrize("args,says", [
    (["model.lora=0"], "model.lora=0: LoRA's rank must be a positive integer"),
    (["model.lora=-4"], "model.lora=-4: LoRA's rank must be a positive integer"),
    (["model.lora=4", "model.lora_targets=[qkv,query]"], "unknown LoRA target 'query'"),
    (["model.lora=4", "model.linear_probe=true"], "model.lora and model.linear_probe are exclusive"),
    (["model.lora=4", "model.lora_alpha=0"], "model.lora_alpha=0.0: must be positive"),
    (["model.lora=4", "model.lora_dropout=1"], "model.lora_dropout=1.0: must be in [0, 1)"),
    (["model.lora=4", "run.strategy=fsdp"], None),  # one process: fsdp runs alone (refused with LoRA below)
])
def test_bad_lora_configs_are_one_line_errors(tmp_path, capsys, args, says):
    out = tmp_path / "run"
    code = main(["train", "fashion-mnist", "--smoke", "data.dataset=digits", f"run.out_dir={out}", "run.progress=false",
                 *args])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists(), err
    assert (says or "model.lora with run.strategy=fsdp is not supported") in err


def test_save_and_export_of_an_unmerged_adapter_model_write_plain_weights(tmp_path):
    """`vitkit.save` and `vitkit.export` of a model with adapters (not merged by hand) write the merged weights: the
    files load as plain models to the adapter model's features."""
    import vitkit
    from vitkit.models.lora import apply_lora

    m = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64,
                            num_classes=3).eval()
    apply_lora(m, 4)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_()
        x = torch.randn(2, 3, 32, 32)
        f = m.forward_features(x)
        for path in (vitkit.save(m, tmp_path / "a.safetensors"), vitkit.export(m, tmp_path / "t", to="timm")):
            back = vitkit.load(path)
            assert not [k for k in back.state_dict() if "lora" in k]
            assert (back.forward_features(x) - f).abs().max() <= 1e-5
