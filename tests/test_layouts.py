"""Checkpoint layouts as data (`vitkit.checkpoints.layouts`) and the format registry (`checkpoints.api.REGISTRY`):
every transformers table read forwards and then backwards gives the peer's own tensors back exactly, on every folder
transformers' `save_pretrained` wrote among the fixtures; a key no rule reads is refused by name; the engine's rules
each do what they say both ways; a new layout is one registry entry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitkit
from vitkit.checkpoints import api, layouts
from vitkit.checkpoints.io import CheckpointError, read_hf_dir
from vitkit.checkpoints.layouts import Layout, Rule

from conftest import FIXTURES, FIXTURES_HERE

# every folder among the fixtures that one of the registry's transformers tables reads
FOLDERS = sorted(p for p in [*FIXTURES_HERE.rglob("config.json"), *FIXTURES.rglob("config.json")]
                 if (p.parent / "model.safetensors").exists() and "readback" not in p.parts)


def _tabled() -> dict[str, tuple[Path, api.Format, dict, dict]]:
    """The folders read by a table (not those vitkit refuses after reading: DeiTForImageClassification)."""
    out = {}
    for cfg_file in FOLDERS:
        raw, cfg = read_hf_dir(cfg_file.parent)
        fmt = api._recognise("folder", raw, cfg)
        if fmt is None or fmt.table is None:
            continue
        try:
            fmt.read(raw, cfg)
        except CheckpointError:
            continue
        out[str(cfg_file.parent.relative_to(cfg_file.parents[2]))] = (cfg_file.parent, fmt, raw, cfg)
    return out


TABLED = _tabled()


def test_every_transformers_family_has_a_table_and_a_folder():
    tabled = {f.name for f in api.REGISTRY if f.table is not None}
    assert tabled == {"hf", "hf-dinov2", "hf-siglip", "hf-siglip2", "hf-clip", "hf-dinov3", "hf-aimv2"}
    assert {fmt.name for _, fmt, _, _ in TABLED.values()} == tabled  # each checked against a folder transformers wrote
    assert len(TABLED) >= 40


def _prefix(layout: Layout, keys) -> str:
    """A task prefix a folder's body keys carry ('' for a base model class)."""
    return next((p for p in layout.prefixes if any(k.startswith(p) for k in keys)), "")


@pytest.mark.parametrize("name", sorted(TABLED))
def test_every_table_reads_back_what_it_wrote(name):
    """Forwards (peer -> vitkit) then backwards (vitkit -> peer) by the same table: every tensor vitkit reads is
    written back under its own name, bit for bit; what it leaves unused (a pooler, a text tower) is all that is
    missing, and what export adds is a constant the table names (a mask token, LayerScale ones)."""
    path, fmt, raw, cfg = TABLED[name]
    layout, flags, ctx = fmt.table(raw, cfg)
    sd, unused = layouts.read(layout, raw, flags, ctx)
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    back, left = layouts.write(layout, sd, flags, {**ctx, "D": sd["patch_embed.proj.weight"].shape[0],
                                                   "depth": depth}, prefix="")
    assert left == []
    # compared without the task prefix (transformers 5 writes some classes' encoders with it and some without, even
    # in one file) and in the table's names where another writer's differ (AltCLIP's `encoder.layer.N`)
    expected = {layouts.body(layout, k): v for k, v in raw.items() if k not in unused}
    assert set(expected) <= set(back)
    for k, v in expected.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    defaults = [layouts._regex(r.peer) for r in layout.rules if r.default is not None]
    added = set(back) - set(expected)
    assert all(any(d.match(k) for d in defaults) for k in added), added


@pytest.mark.parametrize("name", sorted(TABLED))
def test_an_unknown_key_is_refused_by_name(name):
    path, fmt, raw, cfg = TABLED[name]
    stray = _prefix(fmt.table(raw, cfg)[0], raw) + "encoder.layer.0.attention.extra_scale.weight"
    with pytest.raises(CheckpointError, match=f"unexpected Hugging Face .* key '{stray}'"):
        fmt.read({**raw, stray: torch.zeros(2)}, cfg)


# ---- the engine's rules, each both ways, on a small table ---------------------------------------------------------

TOY = Layout("toy", (
    Rule("text.{*}", None, top=True),
    Rule("mask", None, top=True, default=("zeros", (1, "D"))),
    Rule("pos", "pos_embed.weight", transform="embedding"),
    Rule("cls", "cls_token", transform="class_vector"),
    Rule(tuple(f"l.{{i}}.{n}.weight" for n in "qkv"), "blocks.{i}.attn.qkv.weight"),
    Rule(tuple(f"l.{{i}}.{n}.bias" for n in "qkv"), "blocks.{i}.attn.qkv.bias",
         partial=("blocks.{i}.attn.q_bias", None, "blocks.{i}.attn.v_bias")),
    Rule("l.{i}.inp.{w}", ("blocks.{i}.mlp.fc1_g.{w}", "blocks.{i}.mlp.fc1_x.{w}"), when="gated"),
    Rule("l.{i}.inp.{w}", "blocks.{i}.mlp.fc1.{w}", when="!gated"),
    Rule("l.{i}.scale", "blocks.{i}.ls1.gamma", default=("ones", ("D",))),
    Rule("pool.in_{w}", ("attn_pool.q.{w}", "attn_pool.kv.{w}"), sizes=(1, 2)),
    Rule("proj.weight", "head.weight", top=True),
    Rule(None, "head.bias", fill="zeros_rows", like="head.weight", why="the toy's projection has no bias"),
    Rule("old.{*}", top=True, refuse="the toy's old head ({key!r}) is refused"),
), prefixes=("model.",), incomplete="layer {i}: {present} without {missing}")


def _toy(gated: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {"text.emb": (3, 4), "mask": (1, 4), "model.pos": (5, 4), "model.cls": (4,), "model.l.0.q.weight": (4, 4),
         "model.l.0.k.weight": (4, 4), "model.l.0.v.weight": (4, 4), "model.l.0.q.bias": (4,),
         "model.l.0.v.bias": (4,), "model.l.0.inp.weight": (8 if gated else 6, 4), "model.l.0.inp.bias": (8,) if gated
         else (6,), "model.l.0.scale": (4,), "model.pool.in_weight": (12, 4), "model.pool.in_bias": (12,),
         "proj.weight": (3, 4)}
    return {k: torch.randn(s, generator=g) for k, s in t.items()}


@pytest.mark.parametrize("gated", [False, True])
def test_the_engine_reads_and_writes_each_kind_of_rule(gated):
    w, flags = _toy(gated), {"gated"} if gated else set()
    sd, unused = layouts.read(TOY, w, flags)
    assert unused == ["text.emb", "mask"]
    assert sd["pos_embed.weight"].shape == (1, 5, 4) and sd["cls_token"].shape == (1, 1, 4)
    assert torch.equal(sd["blocks.0.attn.qkv.weight"], torch.cat([w[f"model.l.0.{n}.weight"] for n in "qkv"]))
    assert torch.equal(sd["blocks.0.attn.q_bias"], w["model.l.0.q.bias"]) and "blocks.0.attn.qkv.bias" not in sd
    assert sd["attn_pool.q.weight"].shape == (4, 4) and sd["attn_pool.kv.weight"].shape == (8, 4)
    assert (sd["blocks.0.mlp.fc1_g.weight"].shape == (4, 4)) if gated else "blocks.0.mlp.fc1.weight" in sd
    assert not sd["head.bias"].any() and sd["head.bias"].shape == (3,)
    back, left = layouts.write(TOY, sd, flags, {"D": 4, "depth": 1}, prefix="model.")
    assert left == [] and set(back) == set(w) - {"text.emb"}
    assert all(torch.equal(back[k], w[k]) for k in w if k not in unused)
    assert torch.equal(back["mask"], torch.zeros(1, 4))  # unused reading, a constant writing
    sd.pop("blocks.0.ls1.gamma")
    assert torch.equal(layouts.write(TOY, sd, flags, {"D": 4, "depth": 1})[0]["l.0.scale"], torch.ones(4))


def test_the_engine_refuses_by_name():
    w = _toy(False)
    with pytest.raises(CheckpointError, match=r"unexpected Hugging Face toy key 'model\.l\.0\.extra'"):
        layouts.read(TOY, {**w, "model.l.0.extra": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"the toy's old head \('old\.w'\) is refused"):
        layouts.read(TOY, {**w, "old.w": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"layer 0: model\.l\.0\.q\.weight, model\.l\.0\.v\.weight without "
                                              r"l\.0\.k\.weight"):
        layouts.read(TOY, {k: v for k, v in w.items() if k != "model.l.0.k.weight"})
    with pytest.raises(CheckpointError, match="tensors that must have one shape differ: model.l.0.q.weight"):
        layouts.read(TOY, {**w, "model.l.0.q.weight": torch.zeros(2, 4)})
    sd, _ = layouts.read(TOY, w)
    sd["head.bias"] = torch.ones(3)  # the table says the peer's projection has no bias: it cannot be written
    with pytest.raises(CheckpointError, match="the toy's projection has no bias"):
        layouts.write(TOY, sd, ctx={"D": 4, "depth": 1})
    sd.pop("head.bias")
    sd["blocks.0.extra"] = torch.zeros(1)
    assert layouts.write(TOY, sd, ctx={"D": 4, "depth": 1})[1] == ["blocks.0.extra"]  # left for the caller to refuse


def test_two_keys_on_one_tensor_are_refused_naming_both():
    """A tensor stored under two names (with and without the task prefix) is refused, never last-wins; so is a fused
    group's part given twice."""
    w = _toy(False)
    with pytest.raises(CheckpointError, match=r"'model\.cls' and 'cls' both read into 'cls_token'"):
        layouts.read(TOY, {**w, "cls": torch.full((4,), 7.0)})
    with pytest.raises(CheckpointError, match=r"'model\.l\.0\.k\.weight' and 'l\.0\.k\.weight' both read as"):
        layouts.read(TOY, {**w, "l.0.k.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match=r"'model\.l\.0\.q\.bias' and 'l\.0\.q\.bias' both read as"):
        layouts.read(TOY, {**w, "l.0.q.bias": torch.zeros(4)})  # a partial group's part


def test_a_linear_patch_embedding_is_read_by_the_configs_patch_size_and_channels():
    """SigLIP 2's Linear patch embedding is cut by config.json's patch_size, and refused naming the numbers where
    patch * patch * channels is not its inputs (never a guessed patch side for the channels said)."""
    read = layouts.TRANSFORMS["linear_patches"][0]
    t = torch.randn(8, 16 * 16 * 3)
    assert read(t, {"in_chans": 3, "patch_size": 16}).shape == (8, 3, 16, 16)
    with pytest.raises(CheckpointError, match=r"768 inputs.*16 \* 16 \* 12 = 3072"):
        read(t, {"in_chans": 12, "patch_size": 16})
    with pytest.raises(CheckpointError, match="768 inputs"):
        read(t, {"in_chans": 5})  # no patch size said: no guessed side unless it divides exactly
    d = FIXTURES_HERE / "naflex" / "hf_siglip2"
    raw, cfg = read_hf_dir(d)
    (cfg.get("vision_config") or cfg)["num_channels"] = 12
    with pytest.raises(CheckpointError, match="num_channels"):
        api._recognise("folder", raw, cfg).read(raw, cfg)


def test_an_incomplete_qkv_group_names_its_present_and_missing_keys():
    qkv = Layout("qkv", (Rule(("l.{i}.q.{w}", "l.{i}.k.{w}", "l.{i}.v.{w}"), "blocks.{i}.attn.qkv.{w}"),
                         Rule(("l.{i}.query.weight", "l.{i}.key.weight", "l.{i}.value.weight"), "blocks.{i}.attn.qkv.weight")),
                 incomplete=layouts.QKV_INCOMPLETE)
    with pytest.raises(CheckpointError, match=r"layer 0: .*l\.0\.query\.weight, l\.0\.key\.weight without "
                                              r"l\.0\.value\.weight"):
        layouts.read(qkv, {"l.0.query.weight": torch.zeros(2, 2), "l.0.key.weight": torch.zeros(2, 2)})


# ---- the registry: a new layout is one entry ----------------------------------------------------------------------

RENAMED_VIT = Layout("renamed ViT", (
    Rule("emb.cls", "cls_token"), Rule("emb.pos", "pos_embed.weight"), Rule("emb.patch.{w}", "patch_embed.proj.{w}"),
    Rule("layer{i}.{*}", "blocks.{i}.{*}"), Rule("final.{w}", "norm.{w}"), Rule("fc.{w}", "head.{w}"),
), source="toy")


def _renamed_format() -> api.Format:
    def read(raw, cfg):
        sd, unused = layouts.read(RENAMED_VIT, raw)
        return sd, {"num_heads": cfg["heads"] if cfg else 2}, unused

    def write(sd, c):
        out, _ = layouts.write(RENAMED_VIT, sd)
        return out, {"format": "renamed", "heads": c.num_heads}

    return api.Format("toy-renamed", lambda raw, cfg: "emb.patch.weight" in raw, read, target="hf",
                      holds=lambda c: c.num_classes == 3, write=write, label="a toy folder",
                      facts=lambda path, cfg: {})


def test_a_new_layout_is_one_registry_entry(tmp_path, monkeypatch):
    """A layout nobody wrote before: one table and one Format entry, and vitkit reads its files and exports to it."""
    monkeypatch.setattr(api, "REGISTRY", (_renamed_format(), *api.REGISTRY))
    model = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=2, num_classes=3).eval()
    out = vitkit.export(model, tmp_path / "toy", to="hf")
    assert json.loads((out / "config.json").read_text()) == {"format": "renamed", "heads": model.config.num_heads}
    back = vitkit.load(out)
    assert back.load_report["format"] == "toy-renamed"
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert vitkit.load(out / "model.safetensors", num_heads=model.config.num_heads).load_report["format"] == "toy-renamed"


def test_each_export_target_is_written_by_the_first_format_holding_the_model():
    c = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1).config
    assert api._writer("timm", c).name == "timm-vit" and api._writer("npz", c).name == "official-npz"
    assert api.hf_family(c) is None and api._writer("hf", c).name == "hf"
    for kw, fam in ((dict(norm="rmsnorm"), "aimv2"), (dict(classifier="map"), "siglip"), (dict(pre_norm=True), "clip"),
                    (dict(reg_tokens=4), "dinov2"), (dict(init_values=1e-5), "dinov2")):
        c = vitkit.create_model("vit_ti16", img_size=32, patch_size=8, depth=1, **kw).config
        assert api.hf_family(c) == fam and api._writer("hf", c).name == f"hf-{fam}"
