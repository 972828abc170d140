"""The `vitkit` command line: each subcommand is a typed function whose docstring is its help."""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shlex
import signal
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

import safetensors.torch
import yaml

from . import __version__, env, log
from ._cli_util import add_function
from .analysis.commands import explain_images, inspect_model
from .bench import bench
from .cache import atomic_write, check_output, output_dir
from .checkpoints import CATALOG, inspect_checkpoint, load, resolve
from .checkpoints import convert as _convert
from .checkpoints import timm_table
from .data.pack import pack
from .data.splits import feature_splits, test_split
from .demo import demo
from .errors import UsageError, VitkitError
from .training.budget import START_ENV, command_started
from .training.launch import run_ranks, torchrun_command
from .evaluation import evaluate as _evaluate
from .evaluation import fewshot as _fewshot
from .evaluation import check_tta, check_tta_margin, save_confusion_png, write_report
from .evaluation.knn import knn as _knn
from .inference.backends import ExportedModel, PackageModel, inference_engine, load_for_inference
from .inference.export import export_model
from .inference.features import extract_features
from .inference.predict import predict_images
from .machine.device import resolve_device
from .machine.fast_linear import pack_linears
from .machine.precision import for_inference
from .models import ViTConfig, get_entry, list_models
from .models.stats import model_stats
from .models.vit import resolve_layers
from .reproduce import replot as _replot
from .reproduce import reproduce as _reproduce
from .training import PRESETS, run_config
from .training import train as _train


def _torch_version() -> str:

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def models(pattern: str | None = None, num_classes: int = 1000, json_out: bool = False,
           timm: bool = False) -> list[dict]:
    """List every registered model: name, paper name, params, GFLOPs, tokens, resolution.

    GFLOPs are counted with torch.utils.flop_counter on one image at the model's default resolution;
    a multiply-add counts as 2 FLOPs. Only matmuls, convolutions and attention are counted.

    Args:
        pattern: only names matching this glob, e.g. "vit_*".
        num_classes: classes of the head used for the parameter count (Table 1 uses 1000 here).
        json_out: print JSON instead of a table.
        timm: list timm's names instead (every architecture of timm's ViT modules): timm's parameters with its default
            head, and whether vitkit builds it (`vitkit.create_model(name)`) or why not.
    """
    if timm:
        rows = timm_table.rows(pattern)
        if json_out:
            print(json.dumps(rows, indent=1))
            return rows
        for r in rows:
            status = "builds" if r["builds"] else f"refused: {r['refused']}"
            print(f"{r['name']:<48} {r['params'] / 1e6:>10.2f} M  {status}")
        print(f"\nparams: timm.create_model(name) with its default tag's head (timm {timm_table.timm_version()});"
              f" {sum(r['builds'] for r in rows)} of {len(rows)} built by vitkit")
        return rows
    rows = [model_stats(get_entry(n), num_classes) for n in list_models(pattern)]
    if json_out:
        print(json.dumps(rows, indent=1))
        return rows
    head = f"{'name':<16} {'paper name':<21} {'params (M)':>10} {'GFLOPs':>8} {'tokens':>6} {'res':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        tokens = "-" if r["tokens"] is None else str(r["tokens"])
        print(f"{r['name']:<16} {r['paper_name']:<21} {r['params_m']:>10.2f} {r['gflops']:>8.2f} {tokens:>6} {r['resolution']:>5}")
    print(f"\nGFLOPs: forward pass of one image, torch.utils.flop_counter, multiply-add = 2 FLOPs; {num_classes} classes.")
    return rows


def info(checkpoint: str, num_heads: int | None = None, json_out: bool = False) -> dict:
    """Describe a checkpoint: its format, the inferred config, the parameter count and keys left unused.

    Args:
        checkpoint: a checkpoint file, a Hugging Face folder or a catalog name.
        num_heads: for formats that do not store it (timm, torchvision) and a non-standard width.
        json_out: print JSON.
    """
    hints = {"num_heads": num_heads} if num_heads else {}
    r = inspect_checkpoint(resolve(checkpoint), **hints)
    if checkpoint in CATALOG:
        r["catalog_verification"] = CATALOG[checkpoint].verification
    if json_out:
        print(json.dumps(r, indent=1, default=str))
        return r
    c = r["config"]
    print(f"{r['path']}\n  format: {r['format']}\n  params: {r['params']:,} ({r['params'] / 1e6:.2f} M)")
    if "catalog_verification" in r:
        print(f"  download verified by: {r['catalog_verification']}")
    keys = ["img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "classifier", "pos_embed",
            "representation_size", "hybrid_layers", "hybrid_width", "act", "norm_eps", "num_classes"]
    if c["arch"] == "resnetv2":
        keys = ["layers", "channels", "stem_width", "img_size", "num_classes"]
    if c["arch"] == "swin":
        keys = ["img_size", "patch_size", "embed_dim", "depths", "num_heads", "window_size", "mlp_ratio", "num_classes"]
    for k in keys:
        print(f"  {k}: {c[k]}")
    if c["arch"] == "vit":  # the later ViTs' options that are on (LayerScale, registers, RoPE, ...)

        defaults = ViTConfig().to_dict()
        modern = ["hybrid_stem_pool", "hybrid_norm", "init_values", "reg_tokens", "no_embed_class", "pre_norm", "patch_bias", "qk_norm",
                  "attn_norm", "mlp_layer", "mlp_norm", "rope", "rope_ref_grid", "k_bias", "fc_norm", "dynamic_img_size"]
        every = dataclasses.asdict(ViTConfig())  # to_dict leaves out the later fields at their defaults
        for k in modern:
            if c.get(k, every[k]) != defaults.get(k, every[k]):
                print(f"  {k}: {c[k]}")
    print(f"  unused keys: {', '.join(r['unused']) or 'none'}")
    if r["missing"]:
        print(f"  missing keys: {', '.join(r['missing'])}")
    return r


def catalog(pattern: str | None = None, json_out: bool = False) -> list[dict]:
    """List the pretrained checkpoints vitkit can download by name, with how each download is verified.

    A download is checked against a SHA-256 recorded in the catalog, or else against the hash its server publishes
    with the file (Google Cloud Storage: MD5; the Hugging Face hub: SHA-256 of the weights, git blob id of small
    files); an entry whose server states none is listed as unverified.

    Args:
        pattern: only names matching this glob, e.g. "augreg-*".
        json_out: print JSON.
    """
    rows = [{"name": e.name, "format": e.format, "verification": e.verification, "description": e.description,
             "files": e.files} for e in CATALOG.values() if not pattern or fnmatch.fnmatch(e.name, pattern)]
    if json_out:
        print(json.dumps(rows, indent=1))
        return rows
    width = max((len(r["name"]) for r in rows), default=4)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['format']:<12}  {r['verification']}")
    unverified = [r["name"] for r in rows if "unverified" in r["verification"]]
    print(f"\n{len(rows)} entries; {len(unverified)} unverified" + (f": {', '.join(unverified)}" if unverified else ""))
    return rows


def data(action: Literal["pack"], src: str, out: str, shard_size: int = 1000, data_dir: str | None = None) -> dict:
    """Write a dataset as WebDataset-layout tar shards with an index (`vitkit data pack SRC OUT`), for training
    from a folder or a file:// or http(s):// URL with data.dataset=OUT (every sample once per epoch, over any
    number of processes and workers; resumable mid-epoch).

    Args:
        action: pack.
        src: a built-in dataset (fashion-mnist, cifar10, cifar100, digits), an ImageFolder root or a CSV of path,label.
        out: the output folder: train/ and test/ (or val/), each with shard-NNNNNN.tar, .idx.npy files and index.json.
        shard_size: samples per shard.
        data_dir: where the built-in datasets are.
    """
    return pack(src, out, shard_size=shard_size, data_dir=data_dir, progress=print)


def export(
    checkpoint: str,
    out: str,
    format: Literal["onnx", "torch-export", "openvino", "aoti"] = "onnx",
    dynamic_batch: bool = True,
    dynamic_size: bool = False,
    opset: int = 18,
    quantize: Literal["none", "int8"] = "none",
    packed: bool = False,
    precision: Literal["fp32", "bf16"] = "fp32",
) -> dict:
    """Export a checkpoint for deployment (ONNX for onnxruntime, an OpenVINO IR, a torch.export .pt2 program, or
    vitkit's compiled engine: an AOTInductor .pt2 package for this CPU), checked against eager PyTorch on two batch
    sizes and two resolutions: the worst difference is printed, and above 1e-4 (bf16: 5% of the largest logit) the
    export fails.

    Args:
        checkpoint: any checkpoint vitkit loads (ViT, hybrid or BiT).
        out: the file to write (.onnx, .pt2, or .xml for OpenVINO: PATH.xml + PATH.bin).
        format: onnx | torch-export | openvino (converted from the ONNX export, fp32 weights; checked in OpenVINO's
            CPU plugin in f32) | aoti (compiled by AOTInductor for this CPU's instruction set and this torch, the
            weights frozen in; `vitkit serve`, `predict`, `eval` and `bench` run it; it is machine code: load only
            packages you made).
        dynamic_batch: accept any batch size (the default, as timm's onnx_export and optimum export);
            --no-dynamic-batch fixes it at one image.
        dynamic_size: accept any H x W that is a multiple of the patch size (the position embedding is resampled
            in the graph, bilinear; BiT: multiples of 32).
        opset: the ONNX opset.
        quantize: int8: onnxruntime's dynamic int8 quantization of the weights (ONNX; its difference is reported).
        packed: ONNX or aoti whose inputs are packed batches of mixed sizes and aspect ratios (NaFlex; a plain
            ViT): patches (B, L, P*P*C), coords (B, L, 2) int64, valid (B, L) bool; B and L dynamic.
        precision: aoti: fp32 | bf16 (the model under bf16 autocast, bf16 weights; for CPUs with bf16
            instructions). The other formats compute in fp32.
    """
    report = export_model(load(checkpoint), out, format, dynamic_batch=dynamic_batch, dynamic_size=dynamic_size,
                          opset=opset, quantize=None if quantize == "none" else quantize, packed=packed,
                          precision=precision)
    for chk in report.checks:
        print(f"  input {tuple(chk['shape'])}: max |{format} - eager| = {chk['max_abs_diff']:.3g}")
    kind = f"{format}{', int8' if report.quantized else ''}{', bf16' if report.precision == 'bf16' else ''}"
    print(f"wrote {report.path} ({kind}; worst difference {report.worst:.3g})")
    return report.to_dict()


def serve(
    checkpoint: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: Literal["torch", "auto", "aoti", "onnx", "openvino"] = "torch",
    max_batch: int = 8,
    max_wait_ms: float = 5.0,
    max_queue: int = 64,
    max_upload_mb: float = 10.0,
    max_pixels: int = 40_000_000,
    timeout_s: float = 30.0,
    threads: int | None = None,
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
    api_key: str | None = None,
    max_patches: int | None = None,
    max_batch_patches: int | None = None,
    header_timeout_s: float = 5.0,
    keep_alive_s: float = 5.0,
    write_timeout_s: float = 30.0,
    max_connections: int = 2048,
    max_uploads_mb: float = 256.0,
    trust_package: bool = False,
) -> int:
    """Serve a checkpoint over HTTP: POST /predict and /explain, GET /healthz, /model, /metrics, and a web page at /
    to drop an image on and see the top-5 and the attention maps. Requests are micro-batched.

    Args:
        checkpoint: any checkpoint vitkit loads, or an ONNX file (backend onnx), an OpenVINO .xml (backend
            openvino) or an AOTInductor .pt2 package (backend aoti) made by `vitkit export`.
        host: the address to listen on (127.0.0.1: this machine only).
        port: the port.
        backend: torch (eager PyTorch; explanations too) | auto (the fastest engine measured on this machine for
            this model at max_batch among eager fp32/bf16, vitkit's compiled engine fp32/bf16, onnxruntime and
            OpenVINO fp32/bf16, within 5% of fp32 eager's logits; measured once, then cached; the table is printed;
            explanations from eager fp32) | aoti (vitkit's compiled engine: a package from `vitkit export --format
            aoti`, or a checkpoint compiled once for this CPU and cached; --precision bf16 for bf16) | onnx
            (onnxruntime) | openvino (an IR from `vitkit export --format openvino`; --precision bf16 compiles it
            for bf16, otherwise f32). onnx and openvino given a checkpoint export it once (cached).
        max_batch: the most images one forward pass takes.
        max_wait_ms: how long the first request of a batch waits for others.
        max_queue: the most requests waiting for the model; more are answered 503.
        max_upload_mb: the largest request body.
        max_pixels: the largest image (width x height), checked before it is decoded.
        timeout_s: a request's time limit (504 beyond).
        threads: CPU threads for the model.
        precision: backend torch: auto (bf16 where measured faster than fp32 here for this model at max_batch) |
            fp32 | bf16 | fp16 (GPU).
        api_key: requests must send this key (header X-API-Key or Authorization: Bearer KEY), else 401; the page
            takes it as http://HOST:PORT/#key=KEY. Default: $VITKIT_API_KEY. Without one, binding an address other
            than loopback prints a warning.
        max_patches: native aspect ratios (NaFlex; a plain ViT on backend torch): every image resized, keeping its
            aspect ratio, to at most this many patches (no square, no crop), and requests of different sizes
            micro-batched into one packed forward.
        max_batch_patches: the most patch tokens one packed forward computes, padding included (default:
            max_batch x max_patches).
        header_timeout_s: a request's headers must be complete this long after their first byte (after a new
            connection opens), else the connection is answered 408 and closed: a client sending them slowly on
            purpose (slowloris) holds nothing.
        keep_alive_s: a connection with no request in flight that sends nothing is closed after this.
        write_timeout_s: a client that reads nothing of its answer for this long is disconnected.
        max_connections: the most connections open at once; one more closes the longest-idle connection (no
            request in flight), or is answered 503 if all are busy. The open-file limit (ulimit -n) is raised to fit,
            up to its hard limit; below that, fewer, with a warning.
        max_uploads_mb: the request bodies held at once, all requests together (memory); a request whose body
            passes it is answered 503.
        trust_package: serve a compiled package that this machine's vitkit did not compile (from another machine or
            user): its native code runs in the server with your permissions (docs/safety.md). Without it such a
            package is refused.
    """
    from .serve import Limits  # fastapi and uvicorn: the optional [serve] extra
    from .serve import serve as _serve

    _serve(checkpoint, host, port, backend, Limits(max_upload_mb=max_upload_mb, max_pixels=max_pixels, timeout_s=timeout_s,
                                                   max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue,
                                                   max_patches=max_patches, max_batch_patches=max_batch_patches,
                                                   header_timeout_s=header_timeout_s, keep_alive_s=keep_alive_s,
                                                   write_timeout_s=write_timeout_s, max_connections=max_connections,
                                                   max_uploads_mb=max_uploads_mb), threads,
           precision, api_key or env.get("VITKIT_API_KEY"), trust_package)
    return 0


def convert(src: str, dst: str, to: str = "vitkit", num_heads: int | None = None) -> None:
    """Convert a checkpoint between formats; converting out and back in gives the identical output.

    Args:
        src: any checkpoint vitkit can load (official .npz, timm, HF folder, torchvision, vitkit) or a catalog name,
            or a run's sharded checkpoint (run/checkpoints/step-N: its EMA weights if the run kept an EMA).
        dst: the output path (a folder for --to hf).
        to: vitkit | timm | hf | npz.
        num_heads: for source formats that do not store it.
    """
    hints = {"num_heads": num_heads} if num_heads else {}
    if to in ("vitkit", "npz"):  # one file: a FIFO, device, folder or link there is refused before any work
        check_output(dst)  # (a timm or hf folder's files are checked as each is written: `cache.atomic_write`)
    out = _convert(src, dst, to, **hints)
    print(f"wrote {out} ({to})")


def train(
    preset: str | None = None,
    overrides: tuple[str, ...] = (),
    config: str | None = None,
    smoke: bool = False,
    resume: bool = True,
    force: bool = False,
    max_steps: int | None = None,
    nproc: int = 1,
    print_config: bool = False,
) -> int:
    """Train or fine-tune a model from a preset, a YAML/JSON config and key=value overrides.

    Example: vitkit train fashion-mnist optim.lr=1e-3 schedule.epochs=20 run.out_dir=runs/x
    (the preset may come first, or as --preset).
    The resolved config is saved in the run directory; a killed run resumes where it stopped. Ctrl-C (or SIGTERM)
    stops after the step in hand, saves it and prints the command that resumes it (exit 130; 143 for SIGTERM, 129
    for SIGHUP: a closed terminal or ssh session); a
    second Ctrl-C aborts at once (the steps since the last checkpoint lost).
    Several processes: `torchrun --nproc-per-node N -m vitkit train ...` (several machines: add --nnodes and
    --rdzv-endpoint), or --nproc N on this machine; run.strategy picks DDP (the default) or FSDP2.

    Args:
        preset: {presets}. None: the config file's preset, else fashion-mnist for Fashion-MNIST (or no
            dataset named), else none (plain defaults); the run says which.
        overrides: section.field=value pairs (sections: data, aug, model, distill, optim, schedule, run).
        config: a YAML or JSON file applied over the preset, before the overrides.
        smoke: a seconds-long version of the preset (tiny model, a few hundred images).
        resume: continue from run.out_dir/checkpoints/ if it holds one; --no-resume starts fresh (the previous run's files
            move to run.out_dir/previous-<time>/).
        force: resume even if the config changed in a way that changes what a step means (batch size, schedule,
            data, model, optimizer); without it such a resume is refused with the list of differences.
        max_steps: stop after this many optimizer steps (the schedule is unchanged; 0: none, only the evaluation
            and the weights of the start).
        nproc: run this many processes on this machine (torchrun --standalone --nproc-per-node N).
        print_config: print the resolved config as YAML (preset, config file and overrides applied) and exit
            without training.
    """
    overrides = list(overrides)
    if overrides and "=" not in overrides[0]:
        preset = overrides.pop(0)
    if max_steps is not None and max_steps < 0:
        raise UsageError(f"--max-steps {max_steps}: give 0 or more")
    args = ([preset] if preset else []) + overrides + (["--config", config] if config else []) \
        + (["--smoke"] if smoke else []) + (["--force"] if force else []) \
        + (["--max-steps", str(max_steps)] if max_steps is not None else [])
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # relaunch under torchrun, one process per rank
        return run_ranks(torchrun_command(nproc, [*args, *([] if resume else ["--no-resume"])]))
    pairs = {}
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"override {item!r} is not key=value")
        k, v = item.split("=", 1)
        pairs[k] = v
    cfg, preset = run_config(preset, config, pairs, smoke)
    if print_config:
        print(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False), end="")
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(f"vitkit: training from {f'preset {preset}' if preset else 'no preset (plain defaults)'}"
              f"{' (smoke)' if smoke else ''} on {cfg.data.dataset}, into {cfg.run.out_dir}", file=sys.stderr, flush=True)
    result = _train(cfg, resume=resume, max_steps=max_steps, force=force)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result, indent=1))
        if result.get("interrupted"):  # the same run, from its saved step (never --no-resume: that would discard it)
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            print(f"vitkit: resume with: vitkit train {shlex.join([*(['--nproc', str(world)] if world > 1 else []), *args])}",
                  file=sys.stderr, flush=True)
    if not result.get("interrupted"):
        return 0
    return {"SIGINT": 130, "SIGHUP": 129}.get(result.get("signal"), 143)


def _list_presets(fn):
    """Write the registered presets into a command's help (its docstring's {presets})."""
    fn.__doc__ = fn.__doc__.replace("{presets}", " | ".join(PRESETS))
    return fn


train = _list_presets(train)


def evaluate(
    checkpoint: str,
    data: str = "fashion-mnist",
    data_dir: str | None = None,
    test_dir: str | None = None,
    out: str | None = None,
    batch_size: int = 256,
    num_workers: int = 2,
    tta: Literal["none", "flip", "flip-shift", "flip-shift2"] = "none",
    tta_margin: float | None = None,
    device: str = "auto",
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
    backend: Literal["torch", "auto", "aoti", "onnx", "openvino"] = "torch",
    max_patches: int | None = None,
    trust_package: bool = False,
) -> dict:
    """Evaluate a checkpoint on a test set: top-1, top-5, per-class accuracy, a confusion-matrix PNG and a JSON report.

    Args:
        checkpoint: a checkpoint (best.safetensors of a run, or any format vitkit loads).
        data: fashion-mnist | cifar10 | cifar100 | an ImageFolder root (its val/ or test/ is used) | a test CSV.
        data_dir: where the named datasets are.
        test_dir: an explicit test folder or CSV.
        out: folder for eval_report.json and confusion.png (default: next to the checkpoint).
        batch_size: images per forward pass.
        num_workers: decoding workers for folder datasets.
        tta: test-time augmentation: the mean probabilities of the image and its mirror (flip), and of both
            moved by one pixel each way (flip-shift, 10 views), or by one and two (flip-shift2, 18 views). For models
            trained with flips.
        tta_margin: with flip-shift or flip-shift2, a cascade: an image whose mirror pair puts its first class ahead
            of the second by this margin of probability (0 to 1) is answered by those two views, the rest by all
            (0.75 with flip-shift2: the same predictions as every view on Fashion-MNIST's held-out split, at under a
            third of the 18 views' cost; the confident images' loss and top-5 are their two views'). Default: every
            image in every view.
        device: auto (a GPU if there is one) | cpu | cuda | cuda:N.
        precision: auto (bf16 where measured faster than fp32 on this machine for this model, else fp32) | fp32 |
            bf16 | fp16 (GPU).
        backend: torch | auto (the fastest engine measured here within 5% of fp32 eager, as for `vitkit predict`) |
            aoti (vitkit's compiled engine) | onnx | openvino. A package from `vitkit export --format aoti` runs as
            it was compiled.
        max_patches: native aspect ratios (NaFlex): every image resized, keeping its aspect ratio, to at most this
            many patches, each batch packed into one forward (eager torch); default: the checkpoint's square size.
        trust_package: run a compiled package that this machine's vitkit did not compile (from another machine or
            user): its native code runs in this process with your permissions (docs/safety.md). Without it such a
            package is refused.
    """
    check_tta(tta, packed=bool(max_patches))  # before the model loads
    tta_margin = check_tta_margin(tta_margin, tta, "--tta-margin")
    for f in ("eval_report.json", "confusion.png"):  # the outputs' folder and files checked before the work
        check_output(output_dir(Path(out) if out else Path(checkpoint).parent, make=False) / f)
    model, backend = load_for_inference(checkpoint, backend, trust_package)
    dev = resolve_device("cpu" if isinstance(model, (PackageModel, ExportedModel)) and device == "auto" else device)
    model = model.to(dev)
    if max_patches and backend != "torch":
        raise UsageError("--max-patches runs packed batches on eager torch (--backend torch); an ONNX export with "
                         "packed inputs: vitkit export CHECKPOINT OUT.onnx --packed")
    runner, prec, reason = inference_engine(model, dev, precision, backend, batch_size)
    # the test split (a CSV, an ImageFolder's val/ or test/, a named dataset or shards), decoded as the checkpoint asks
    split = test_split(model.config, data, data_dir=data_dir, test_dir=test_dir, max_patches=max_patches)
    test, transform = split.test, split.transform(split.test)
    res = _evaluate(runner, test, transform, batch_size=batch_size, num_workers=num_workers, tta=tta,
                    tta_margin=tta_margin, device=dev, precision=prec)
    out_dir = Path(out) if out else Path(checkpoint).parent
    write_report(res, out_dir / "eval_report.json", {"checkpoint": str(checkpoint), "data": data, "tta": tta,
                                                     "tta_margin": tta_margin,
                                                     "precision": reason, "backend": backend,
                                                     "max_patches": max_patches})
    save_confusion_png(res, out_dir / "confusion.png")
    print(f"{checkpoint} on {data}: top-1 {res.acc1:.4f}  top-5 {res.acc5:.4f}  loss {res.loss:.4f}  (n = {res.n}, skipped {res.skipped})")
    width = max(len(n) for n in res.classes)
    for name, acc in zip(res.classes, res.per_class):
        print(f"  {name:<{width}}  {acc:.4f}")
    print(f"wrote {out_dir / 'eval_report.json'} and {out_dir / 'confusion.png'}")
    return res.to_dict()


def fewshot(
    checkpoint: str,
    data: str = "fashion-mnist",
    shots: tuple[int, ...] = (1, 5, 10, 25),
    draws: int = 5,
    seed: int = 0,
    data_dir: str | None = None,
    train_subset: int | None = None,
    json_out: bool = False,
    device: str = "auto",
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
) -> dict:
    """Few-shot linear accuracy of a checkpoint's frozen features, as the paper reports it: k training images per
    class, a closed-form regularised least-squares fit to {-1, 1} targets, the test set scored; mean ± std over
    random draws of the shots (the regularisation chosen per draw on other training images).

    Args:
        checkpoint: any checkpoint vitkit loads.
        data: the downstream dataset: a built-in (fashion-mnist, cifar10, digits, ...), an ImageFolder or shards.
        shots: images per class.
        draws: random draws of the shots.
        seed: the draws' seed.
        data_dir: where the built-in datasets are.
        train_subset: draw the shots (and the held-out images) from only this many training images (faster).
        json_out: print JSON.
        device: auto | cpu | cuda | cuda:N.
        precision: auto (bf16 where measured faster than fp32 here) | fp32 | bf16 | fp16 (GPU).
    """
    model, dev, prec, train_set, test_set, replicate = _frozen_backbone(checkpoint, data, data_dir, train_subset, device,
                                                                        precision)
    res = _fewshot(model, train_set, test_set, shots=tuple(shots), draws=draws, seed=seed, replicate_to=replicate, device=dev,
                   precision=prec)
    if json_out:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        print(f"{checkpoint} on {data}, {draws} draws: {res}")
    return res.to_dict()


def _frozen_backbone(checkpoint: str, data: str, data_dir: str | None, train_subset: int | None, device: str,
                     precision: str):
    """What `fewshot` and `knn` share: the model on its device, the precision for its features, the dataset's splits
    (the training split cut to `train_subset` images), and the channel replication grey data needs for an RGB model."""
    dev = resolve_device(device)
    model = load(checkpoint).to(dev)
    choice = for_inference(model, dev, precision, 500)
    splits = feature_splits(model.config, data, data_dir=data_dir, train_subset=train_subset)
    return model, dev, choice.precision, splits.train, splits.test, splits.replicate_to


def knn(
    checkpoint: str,
    data: str = "fashion-mnist",
    k: tuple[int, ...] = (10, 20),
    temperature: float = 0.07,
    data_dir: str | None = None,
    train_subset: int | None = None,
    json_out: bool = False,
    device: str = "auto",
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
) -> dict:
    """k-nearest-neighbour accuracy of a checkpoint's frozen features (DINO's evaluation of self-supervised
    backbones): the training split's L2-normalised pooled features are the memory bank; each test image's k most
    cosine-similar ones vote with weight exp(similarity / temperature).

    Args:
        checkpoint: any checkpoint vitkit loads (a DINOv2 backbone, a CLIP or SigLIP image tower, a ViT).
        data: the dataset: a built-in (fashion-mnist, cifar10, digits, ...), an ImageFolder or shards.
        k: numbers of neighbours.
        temperature: of the vote's weights; 0 gives every neighbour one vote.
        data_dir: where the built-in datasets are.
        train_subset: use only this many training images as the memory bank (faster).
        json_out: print JSON.
        device: auto | cpu | cuda | cuda:N.
        precision: auto (bf16 where measured faster than fp32 here) | fp32 | bf16 | fp16 (GPU).
    """
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    model, dev, prec, train_set, test_set, replicate = _frozen_backbone(checkpoint, data, data_dir, train_subset, device,
                                                                        precision)
    res = _knn(model, train_set, test_set, ks=tuple(k), temperature=temperature or None, replicate_to=replicate,
               device=dev, precision=prec)
    if json_out:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        print(f"{checkpoint} on {data} ({res.train_images} train, {res.test_images} test images): {res}")
    return res.to_dict()


def features(
    images: list[str],
    checkpoint: str = "runs/fashion-mnist/best.safetensors",
    out: str = "features.safetensors",
    dense: bool = False,
    layers: tuple[int, ...] = (-1,),
    device: str = "auto",
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
) -> int:
    """Write frozen features of image files to a .safetensors file: `pooled` (N, D), the representation k-NN,
    few-shot and linear probes read; with --dense, each chosen block's patch tokens as feature maps
    `patch_grid.L` (N, D, H/P, W/P) (after the final norm) and its prefix tokens `prefix.L` (class, registers).
    The file's metadata lists the images (row order). An unreadable image is reported, the others written; the exit
    status is then 1.

    Args:
        images: image files.
        checkpoint: any checkpoint vitkit loads.
        out: the .safetensors file to write.
        dense: also write dense patch features.
        layers: the blocks for --dense (negative from the end).
        device: auto | cpu | cuda | cuda:N.
        precision: auto (bf16 where measured faster than fp32 here) | fp32 | bf16 | fp16 (GPU).
    """
    check_output(out)  # a FIFO, device, folder or link as --out: refused before any work
    dev = resolve_device(device)
    model = load(checkpoint).to(dev)
    if getattr(model.config, "arch", "vit") != "vit":
        raise UsageError(f"features: a ViT checkpoint (a {model.config.arch} model has no token sequence; its pooled "
                         f"features come from `vitkit knn` / `fewshot`)")
    resolve_layers(list(layers), model.config.depth)  # a bad index is refused before any image is read
    choice = for_inference(model, dev, precision, min(len(images), 32))
    tensors, records = extract_features(model, images, dense=dense, layers=list(layers), precision=choice.precision)
    for r in records:
        if "error" in r:
            print(f"{r['image']}: ERROR {r['error']}")
    if tensors:
        meta = {"images": json.dumps([r["image"] for r in records if "row" in r]), "checkpoint": str(checkpoint)}
        atomic_write(Path(out), lambda p: safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(p), metadata=meta))
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
        print(f"wrote {out}: {shapes}")
    return _exit_status(records)


def reproduce(name: str, seeds: int = 3, smoke: bool = False, out: str = "docs/reproductions", replot: bool = False) -> dict:
    """Reproduce one of the paper's findings at laptop scale: posemb (Table 8), pooling (Fig. 9), data-scale
    (Fig. 3-5), mpp (Sec. 4.6) or distill (DeiT). Trains every variant with every seed on Fashion-MNIST / digits and
    writes a markdown table (mean ± std) and a plot to OUT/NAME.md and .png. A full study takes up to ~30 minutes
    on a 2-core CPU, --smoke about 2.

    Args:
        name: posemb | pooling | data-scale | mpp | distill.
        seeds: how many seeds per variant.
        smoke: a seconds-per-run version (tiny subsets) that checks everything runs.
        out: the folder for the table, plot and raw results.
        replot: write the table and the plot again from OUT/NAME.json, without training.
    """
    res = _replot(name, out, smoke) if replot else _reproduce(name, seeds=seeds, smoke=smoke, out=out)
    print(Path(out, name + ("-smoke" if smoke else "") + ".md").read_text())
    return res


def predict(
    images: list[str],
    checkpoint: str = "runs/fashion-mnist/best.safetensors",
    top_k: int = 3,
    out: str | None = None,
    format: Literal["auto", "table", "json", "jsonl", "csv"] = "auto",
    resume: bool = False,
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    tta: Literal["none", "flip", "flip-shift", "flip-shift2"] = "none",
    device: str = "auto",
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
    backend: Literal["torch", "auto", "aoti", "onnx", "openvino"] = "torch",
    max_patches: int | None = None,
    trust_package: bool = False,
) -> int:
    """Classify images with a checkpoint's own preprocessing and class names: files, folders, CSV lists and shard
    sets, any number, in batches, decoded ahead of the model; each batch's results are written as soon as it is
    done. A record per image, {"image", "top": [{"index", "label", "probability"}, ...]} as the service answers,
    or {"image", "error"} for one that cannot be read (the others are still classified; the exit status is then
    1). SIGTERM or Ctrl-C stops after the batch in hand (exit 143 / 130), every finished batch written; the same
    command with --resume carries on where it stopped.

    Args:
        images: image files; folders (every image file below them, in sorted order); CSV lists of path,label rows
            (as `vitkit eval` reads them; relative paths from the CSV's folder); shard sets of `vitkit data pack`
            (a split folder or URL with index.json, or a set's root: all its splits). Mixed freely: the records
            follow this order.
        checkpoint: any checkpoint vitkit loads, or a package from `vitkit export --format aoti` (run as compiled).
        top_k: how many classes per image.
        out: write the records to this file (flushed after every batch) instead of stdout.
        format: auto (from --out's suffix: .jsonl/.ndjson, .json, .csv, .txt; table on stdout) | table (for
            people) | json (one array) | jsonl (a record per line) | csv (image,rank,index,label,probability,error:
            a row per class, one row per unreadable image).
        resume: with --out FILE (jsonl or csv) from an earlier run of the same command, stopped or killed: keep its
            records (a line cut short by a kill is dropped), skip those images and append the rest; the file ends
            as an uninterrupted run's. A FILE whose records are not the first inputs' is refused.
        batch_size: images per forward pass (keep it the same when resuming, for identical numbers).
        num_workers: threads decoding images ahead of the model (0: decoded between forward passes).
        progress: a progress line on stderr (redrawn in place on a terminal; otherwise a line every tenth of the
            images or 30 s).
        tta: test-time augmentation, as for `vitkit eval`.
        device: auto (a GPU if there is one) | cpu | cuda | cuda:N.
        precision: auto (bf16 where measured faster than fp32 here) | fp32 | bf16 | fp16 (GPU).
        backend: torch (eager PyTorch) | auto (the fastest engine measured on this machine for this model and batch
            among eager fp32/bf16, vitkit's compiled engine fp32/bf16, onnxruntime and OpenVINO fp32/bf16, within 5%
            of fp32 eager's logits; measured once, then cached; prints the table) | aoti (vitkit's compiled engine:
            the checkpoint compiled once for this CPU by AOTInductor, cached; --precision bf16 for bf16) | onnx |
            openvino (the checkpoint exported once and cached).
        max_patches: native aspect ratio (NaFlex): each image resized, keeping its aspect ratio, to at most this many
            patches, the images packed into one forward of mixed sizes (eager torch); default: the checkpoint's
            square size.
        trust_package: run a compiled package that this machine's vitkit did not compile (from another machine or
            user): its native code runs in this process with your permissions (docs/safety.md). Without it such a
            package is refused.
    """
    res = predict_images(images, checkpoint, top_k=top_k, out=out, format=format, resume=resume,
                         batch_size=batch_size, num_workers=num_workers, progress=progress, tta=tta, device=device,
                         precision=precision, backend=backend, max_patches=max_patches, trust_package=trust_package)
    where = f"; records in {out}" if out else ""
    if res.stopped is not None and res.stopped != getattr(signal, "SIGPIPE", 13):
        name = signal.Signals(res.stopped).name
        print(f"vitkit: predict: stopped by {name} after {res.resumed + res.done_now:,} of {res.total:,} images"
              f"{where}; the same command with --resume carries on", file=sys.stderr, flush=True)
        _unreadable(res.failed, res.resumed + res.done_now)
        return 128 + res.stopped
    if progress:
        print(res.done_line(out), file=sys.stderr, flush=True)
    return _unreadable(res.failed, res.total)


def _exit_status(records: list[dict]) -> int:
    """0, or 1 after naming the inputs that could not be read (records with an "error"), on stderr."""
    return _unreadable([r["image"] for r in records if "error" in r], len(records))


def _unreadable(failed: list[str], total: int) -> int:
    """0, or 1 after naming the `failed` of `total` inputs that could not be read, on stderr."""
    if failed:
        print(f"vitkit: {len(failed)} of {total} image(s) could not be read: {', '.join(failed[:5])}"
              f"{' ...' if len(failed) > 5 else ''}", file=sys.stderr)
        return 1
    return 0


def explain(
    images: list[str],
    checkpoint: str = "runs/fashion-mnist/best.safetensors",
    out: str = "explain",
    discard_ratio: float = 0.0,
    head_fusion: Literal["mean", "max", "min"] = "mean",
    class_index: int | None = None,
) -> int:
    """Show what a ViT attends to: attention rollout overlaid on each image, gradient-weighted rollout for a
    class, and per-layer, per-head maps; for the BiT CNN, a Grad-CAM overlay. Writes PNGs and the raw maps (.npz).
    An image that cannot be read is reported and the others are still explained; the exit status is then 1.

    Args:
        images: image files.
        checkpoint: any checkpoint vitkit loads.
        out: output folder.
        discard_ratio: the fraction of the lowest attentions dropped per layer before rollout (0: the paper's rollout).
        head_fusion: how the heads are combined: mean (the paper), max or min.
        class_index: the class for gradient-weighted rollout (default: the predicted class).
    """
    model = load(checkpoint)
    pack_linears(model)  # float32 on CPU: the fastest GEMM measured here
    recs = explain_images(model, images, out, discard_ratio=discard_ratio, head_fusion=head_fusion, class_index=class_index)
    for r in recs:
        if "error" in r:
            print(f"{r['image']}: ERROR {r['error']}")
            continue
        pngs = ", ".join(p for p in (r["png"], r["heads_png"]) if p)
        print(f"{r['image']}: {r.get('class', '')} -> {pngs}, {r['npz']}")
    return _exit_status(recs)


def _run_name(checkpoint: str) -> str:
    """A readable name for figure titles: the run folder for a run's best/final/last checkpoint."""
    p = Path(checkpoint)
    return p.parent.name if p.stem in ("best", "final", "last") else p.stem


def inspect(
    checkpoint: str = "runs/fashion-mnist/best.safetensors",
    data: str | None = None,
    out: str = "inspect",
    num_images: int = 64,
    components: int = 28,
    data_dir: str | None = None,
) -> dict:
    """Fig. 7 for a checkpoint: the top principal components of the patch-embedding filters, the cosine
    similarity of position embeddings, and (with --data) the mean attention distance per head against depth.

    Args:
        checkpoint: any checkpoint vitkit loads (a ViT or hybrid).
        data: images for the attention distance: a dataset name (fashion-mnist, cifar10, digits) or a folder.
        out: output folder.
        num_images: how many images to average the attention distance over.
        components: how many principal components to show.
        data_dir: where the named datasets are.
    """
    res = inspect_model(load(checkpoint), out, data=data, data_dir=data_dir, num_images=num_images,
                        components=components, name=_run_name(checkpoint))
    for k, v in res.items():
        print(f"{k}: {v}")
    return res


COMMANDS = {"fewshot": fewshot, "knn": knn, "features": features, "reproduce": reproduce, "models": models, "catalog": catalog, "data": data, "export": export, "serve": serve, "bench": bench, "explain": explain, "inspect": inspect, "demo": demo, "info": info, "convert": convert, "train": train, "eval": evaluate, "predict": predict}


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error contract: one line, `vitkit COMMAND: error: ...`, exit 2 (`--help` has the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vitkit", description="Vision Transformers (arXiv 2010.11929) in PyTorch.")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of every error, expected ones too")
    parser.add_argument("--version", action="version", version=f"vitkit {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn in COMMANDS.items():
        add_function(sub, name, fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # positionals after an option (`train fashion-mnist --smoke a=b`) land in `extra`: they are more overrides
    if extra and hasattr(ns, "overrides") and not any(e.startswith("-") for e in extra):
        ns.overrides = list(ns.overrides) + extra
    elif extra:  # the command's own parser says it, so the help it points at is the command's
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args = vars(ns)
    fn = args.pop("_fn")
    args.pop("command")
    debug = args.pop("debug")
    log.show()  # vitkit's messages on stderr as `vitkit: ...` lines (`vitkit.log`)
    # when this command started, for the processes it launches (torchrun's keep their launcher's) and for
    # `schedule.time_budget`; put back as it was when the command returns
    previous_start = os.environ.get(START_ENV)
    launched = "TORCHELASTIC_RUN_ID" in os.environ and previous_start is not None  # `--nproc N`'s processes
    if not launched:
        os.environ[START_ENV] = command_started(process_entry=argv is None)
    try:
        env.check_all()  # every VITKIT_* knob that is set, before any work (`vitkit.env`)
        ret = fn(**args)
    except (VitkitError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        # an expected failure (bad input, a missing file, a config that cannot work): its message is the answer
        if debug:
            traceback.print_exc()
        print(f"vitkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vitkit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - anything else is a bug: keep its cause
        traceback.print_exc()
        print(f"vitkit: unexpected error ({type(e).__name__}: {e}); the traceback above shows where. "
              f"Please report it with the command that caused it.", file=sys.stderr)
        return 1
    finally:
        if not launched:
            if previous_start is None:
                os.environ.pop(START_ENV, None)
            else:
                os.environ[START_ENV] = previous_start
    return ret if isinstance(ret, int) else 0


if __name__ == "__main__":
    sys.exit(main())
