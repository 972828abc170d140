"""What the service runs: a model (PyTorch, vitkit's compiled engine, onnxruntime or OpenVINO) behind the checkpoint's own preprocessing, and a
micro-batcher that groups concurrent requests into one forward pass without blocking the event loop."""
from __future__ import annotations

import asyncio
import io
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from ..analysis.attention import rollout, token_map
from ..analysis.plots import overlay, upsample
from ..checkpoints import load
from ..data.image import EvalTransform, load_image, resize_crop, to_uint8_tensor
from ..data.naflex import PackTransform
from ..errors import CheckpointError, UsageError
from ..inference.backends import PackageModel, is_package, open_engine
from ..inference.export import onnx_config, openvino_compile, openvino_config
from ..inference.predict import top_classes
from ..machine.engine import check_backend
from ..machine.engine_probe import import_onnxruntime, import_openvino
from ..machine.precision import autocast, for_inference
from ..machine.threads import Governor
from ..models.layers.packing import pack, resize_to_patches
from ..safety import untrusted


class Predictor:
    """logits for a batch of preprocessed images; `config` holds the preprocessing and class names."""

    config: SimpleNamespace
    backend: str
    explains = False
    # native aspect ratios (NaFlex, `vitkit serve --max-patches N`): each image resized, keeping its aspect ratio, to
    # at most this many patches, and a batch of them packed into one forward; None: the checkpoint's square size
    max_patches: int | None = None
    threads: int | None = None  # the CPU threads asked for (--threads); None: torch's follow the load (`MicroBatcher`)

    def __call__(self, x: np.ndarray | list[np.ndarray]) -> np.ndarray:
        """(B, C, H, W) float32 -> (B, K); with max_patches, a list of (C, H_i, W_i) -> (B, K), one packed forward."""
        raise NotImplementedError

    def preprocess(self, data: bytes, max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
        """Image bytes -> (the model's input (C, H, W) float32, the cropped image as uint8 (H, W[, C]) for display).
        Raises ImageDecodeError for anything that is not a decodable image within the pixel limit."""
        c = self.config
        img = load_image(io.BytesIO(data), c.in_chans, max_pixels=max_pixels)
        if self.max_patches:  # its own aspect ratio at the patch budget: no crop, no square (as `vitkit predict`)

            packer = PackTransform.for_model(c, self.max_patches)
            h, w = resize_to_patches(img.height, img.width, tuple(c.patch_size), self.max_patches)
            if img.height * img.width > 16 * h * w:  # a large photo: PIL's box reduction first (memory), then the resize
                img = img.reduce(max(1, min(img.height // (2 * h), img.width // (2 * w))))
            x = packer.image(to_uint8_tensor(img))
            shown = (x * torch.tensor(c.std[: x.shape[0]])[:, None, None] + torch.tensor(c.mean[: x.shape[0]])[:, None, None])
            shown = (shown.clamp(0, 1) * 255).round().to(torch.uint8)
            return x.numpy(), (shown[0].numpy() if shown.shape[0] == 1 else shown.permute(1, 2, 0).numpy())
        pixels = to_uint8_tensor(resize_crop(img, tuple(c.img_size), c.crop_pct, c.interpolation))
        x = EvalTransform.for_model(c, geometry=False)(pixels[None])[0].numpy()
        shown = pixels[0].numpy() if pixels.shape[0] == 1 else pixels.permute(1, 2, 0).numpy()
        return x, shown


class TorchPredictor(Predictor):
    backend = "torch"

    def __init__(self, model: torch.nn.Module, precision: str = "fp32", batch: int = 8) -> None:
        """precision: auto | fp32 | bf16, resolved for a forward of `batch` images (`vitkit.machine.precision`)."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.precision = for_inference(self.model, self.device, precision, batch)  # fp32: the packed fast GEMM
        self.config = model.config
        self.explains = hasattr(model, "embed")  # a ViT or hybrid: attention rollout (not BiT, not Swin's windows)

    def __call__(self, x: np.ndarray) -> np.ndarray:

        if isinstance(x, list):  # images of different sizes: one packed forward

            # every row padded to the budget: one shape per batch size (the packed GEMMs keep their packing)
            batch = pack([torch.from_numpy(im) for im in x], tuple(self.config.patch_size), length=self.max_patches).to(self.device)
            with torch.no_grad(), autocast(self.precision.precision, self.device):
                return self.model(batch).float().cpu().numpy()
        with torch.no_grad(), autocast(self.precision.precision, self.device):
            return self.model(torch.from_numpy(x).to(self.device)).float().cpu().numpy()


class OnnxPredictor(Predictor):
    backend = "onnx"

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        ort = import_onnxruntime()  # optional: the [deploy] extra; its telemetry off

        d = onnx_config(path)
        d.pop("arch", None)
        self.config = SimpleNamespace(**{**d, "img_size": tuple(d["img_size"]), "mean": tuple(d["mean"]), "std": tuple(d["std"])})
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        shape = self.session.get_inputs()[0].shape
        self.fixed_batch = shape[0] if isinstance(shape[0], int) else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.fixed_batch and len(x) != self.fixed_batch:  # an export without --dynamic-batch: one image at a time
            return np.concatenate([self.session.run(None, {self.input: np.repeat(x[i:i + 1], self.fixed_batch, 0)})[0][:1]
                                   for i in range(len(x))])
        return self.session.run(None, {self.input: x})[0]


class OpenVinoPredictor(Predictor):
    """An OpenVINO IR made by `vitkit export --format openvino`, compiled for the CPU in fp32 or bf16
    (INFERENCE_PRECISION_HINT, read back)."""

    backend = "openvino"

    def __init__(self, path: str | Path, threads: int | None = None, precision: str = "fp32") -> None:

        d = openvino_config(path)
        d.pop("arch", None)
        self.config = SimpleNamespace(**{**d, "img_size": tuple(d["img_size"]), "mean": tuple(d["mean"]), "std": tuple(d["std"])})
        self.precision = precision
        self.compiled = openvino_compile(path, precision, threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.compiled(x)[0]


class PackagePredictor(Predictor):
    """A package made by `vitkit export --format aoti` (vitkit's compiled engine), run as it was compiled."""

    backend = "aoti"

    def __init__(self, path: str | Path, threads: int | None = None, trust: bool = False) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model = PackageModel(path, trust=trust)  # through the one door (vitkit.machine.aoti.open_package)
        self.config, self.precision = self.model.config, self.model.precision
        self.backend = f"aoti-{self.precision}"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.model(torch.from_numpy(x)).numpy()


class EnginePredictor(Predictor):
    """A checkpoint on the engine `vitkit.inference.backends` chose (`--backend auto`) or exported for (onnx or
    openvino given a checkpoint): predictions there, explanations from the eager fp32 model."""

    def __init__(self, model: torch.nn.Module, backend: str, precision: str, batch: int, threads: int | None) -> None:

        self.engine = open_engine(model, backend, precision, batch, threads)
        choice = self.choice = self.engine.choice
        self.backend, self.precision = choice.name, choice.precision
        self.model, self.config = model, model.config
        self.explains = hasattr(model, "embed")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.engine.run(x)


def load_predictor(checkpoint: str, backend: str = "torch", threads: int | None = None, precision: str = "auto",
                   max_batch: int = 8, trust_package: bool = False) -> Predictor:
    """What the service runs for `checkpoint` on `backend`. A compiled package this machine's vitkit did not make
    loads only with `trust_package` (its native code runs in the server). An ONNX file (.onnx) runs on onnxruntime
    and an OpenVINO IR (.xml) on OpenVINO with the default backend (torch) or auto."""
    check_backend(backend)
    if is_package(checkpoint):  # vitkit's compiled engine, as `vitkit export --format aoti` made it
        if backend not in ("torch", "auto", "aoti"):
            raise UsageError(f"{checkpoint} is an AOTInductor package: serve it with --backend aoti")
        with untrusted(str(checkpoint), CheckpointError):
            served = PackagePredictor(checkpoint, threads, trust=trust_package)
        if precision not in ("auto", served.precision):
            raise UsageError(f"{checkpoint} computes in {served.precision}, not {precision}")
        return served
    exported = str(checkpoint).endswith((".onnx", ".xml"))
    if exported and backend in ("torch", "auto"):  # the file names its runtime: an export runs where it was made for
        backend = "onnx" if str(checkpoint).endswith(".onnx") else "openvino"
    if backend in ("auto", "aoti") or (backend in ("onnx", "openvino") and not exported):  # measured or exported

        check_backend(backend)
        if threads:
            torch.set_num_threads(threads)
        return EnginePredictor(load(checkpoint), backend, precision, max_batch, threads)
    if backend == "openvino":

        if not str(checkpoint).endswith(".xml"):
            raise UsageError("--backend openvino serves an OpenVINO IR (.xml + .bin) made by `vitkit export "
                             "--format openvino`, or a checkpoint (exported once and cached)")
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"no OpenVINO IR at {checkpoint}")
        if precision not in ("auto", "fp32", "bf16"):
            raise UsageError(f"--backend openvino computes in fp32 or bf16, not {precision}")
        try:
            import_openvino()
        except ImportError as e:
            raise UsageError("--backend openvino needs openvino: pip install 'vitkit[openvino]'") from e
        with untrusted(str(checkpoint), CheckpointError):
            return OpenVinoPredictor(checkpoint, threads, "bf16" if precision == "bf16" else "fp32")
    if backend == "onnx":
        if not str(checkpoint).endswith(".onnx"):
            raise UsageError("--backend onnx serves a .onnx file made by `vitkit export`")

        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"no ONNX file at {checkpoint}")
        with untrusted(str(checkpoint), CheckpointError):  # onnx and onnxruntime raise their own types on bad bytes
            return OnnxPredictor(checkpoint, threads)
    if backend != "torch":
        raise UsageError(f"backend must be auto, torch, aoti, onnx or openvino, got {backend!r}")

    if threads:
        torch.set_num_threads(threads)
    return TorchPredictor(load(checkpoint), precision, max_batch)


class QueueFull(Exception):
    """The service is at its bound of waiting requests: answer 503, never queue without limit."""


@dataclass
class BatchStats:
    batches: int = 0
    images: int = 0
    seconds: float = 0.0
    tokens: int = 0  # patch tokens computed (packed batches: padding included)
    padding: int = 0  # of which padding


def take_packed(sizes: list[int], max_batch: int, max_tokens: int, length: int = 0) -> int:
    """How many of the waiting images (their patch counts, in arrival order) the next packed forward takes: as many
    as fit `max_batch` images and `max_tokens` padded tokens (images x the row length: the longest image, or `length`
    when rows are padded to it), at least one."""
    n, longest = 0, length
    for s in sizes[:max_batch]:
        if n and (n + 1) * max(longest, s) > max_tokens:
            break
        n, longest = n + 1, max(longest, s)
    return max(n, 1)


class MicroBatcher:
    """Groups requests that arrive together: a batch runs when `max_batch` are waiting or `max_wait_ms` after the
    first, in one worker thread (the event loop never waits on the model). At most `max_queue` requests wait.
    On the CPU, that thread sets torch's thread count before each batch to the cores other processes leave
    (`vitkit.machine.threads.Governor`; the predictor's `threads` fix it).
    With a predictor of packed batches (`max_patches`), images of different sizes go into one forward, as many as
    fit `max_batch` and `max_tokens` padded patch tokens."""

    def __init__(self, predictor: Predictor, max_batch: int = 8, max_wait_ms: float = 5.0, max_queue: int = 64,
                 max_tokens: int | None = None) -> None:
        self.predictor, self.max_batch, self.max_wait = predictor, max_batch, max_wait_ms / 1000
        self.max_queue = max_queue
        self.packed = bool(getattr(predictor, "max_patches", None))
        self.max_tokens = max_tokens or max_batch * (predictor.max_patches or 1)
        self.pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitkit-model")
        self.lock = threading.Lock()  # the model runs one batch (or one explanation) at a time
        on_cpu = torch.device(getattr(predictor, "device", None) or "cpu").type == "cpu"
        self.governor = Governor(getattr(predictor, "threads", None)) if on_cpu else None
        self.stats = BatchStats()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return len(self.pending)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, x: np.ndarray) -> np.ndarray:
        if len(self.pending) >= self.max_queue:
            raise QueueFull(f"{len(self.pending)} requests are already waiting (the bound is {self.max_queue})")
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((x, fut))
        self._wake.set()
        return await fut

    async def run_exclusive(self, fn, *args):
        """Run `fn` on the model's thread, between batches (an explanation)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._locked, fn, *args)

    def _locked(self, fn, *args):
        with self.lock:
            if self.governor is not None:
                self.governor.step()  # in the model's thread (some OpenMP runtimes keep a count per thread)
            return fn(*args)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.pending:
                continue
            deadline = loop.time() + self.max_wait
            while len(self.pending) < self.max_batch and loop.time() < deadline:
                await asyncio.sleep(min(0.001, max(0.0, deadline - loop.time())))
            take = self.max_batch
            if self.packed:
                p = self.predictor.config.patch_size
                take = take_packed([(x.shape[1] // p[0]) * (x.shape[2] // p[1]) for x, _ in self.pending],
                                   self.max_batch, self.max_tokens, self.predictor.max_patches)
            batch, self.pending = self.pending[:take], self.pending[take:]
            if self.pending:
                self._wake.set()
            live = [(x, f) for x, f in batch if not f.done()]  # a request that timed out is dropped
            if not live:
                continue
            t0 = time.perf_counter()
            try:
                inputs = [x for x, _ in live] if self.packed else np.stack([x for x, _ in live])
                logits = await loop.run_in_executor(self.executor, self._locked, self.predictor, inputs)
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the loop goes on
                for _, f in live:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.stats.batches += 1
            self.stats.images += len(live)
            self.stats.seconds += time.perf_counter() - t0
            if self.packed:
                p = self.predictor.config.patch_size
                n = [(x.shape[1] // p[0]) * (x.shape[2] // p[1]) for x, _ in live]
                length = max(max(n), self.predictor.max_patches)  # rows are padded to the budget
                self.stats.tokens += len(n) * length
                self.stats.padding += len(n) * length - sum(n)
            for (_, f), row in zip(live, logits):
                if not f.done():
                    f.set_result(row)


def softmax_top(logits: np.ndarray, names: list[str], k: int) -> list[dict]:
    """One image's logits -> its top-k entries {"index", "label", "probability"}: `inference.predict.top_classes`,
    the schema of `vitkit predict`'s records too."""
    z = logits.astype(np.float64) - logits.max()
    p = np.exp(z) / np.exp(z).sum()
    return top_classes(p, names, k)


def explanations(model: torch.nn.Module, x: np.ndarray) -> dict:
    """Everything the web page draws for one image: per layer, the attention rollout up to that layer, the
    gradient-weighted rollout up to that layer (for the predicted class) and each head's attention from the class
    token (or the mean patch, without one); all as (gh, gw) maps with a maximum of 1."""
    c = model.config
    xt = torch.from_numpy(x)[None]
    grid = (x.shape[1] // c.patch_size[0], x.shape[2] // c.patch_size[1])  # a packed image's own grid, else the model's
    with torch.enable_grad():
        out = model.forward_intermediates(xt, attention=True)
        logits = out["logits"]
        idx = int(logits.argmax(-1))
        attns = [out["attention"][i] for i in sorted(out["attention"])]
        grads = torch.autograd.grad(logits[0, idx], attns)
    p = c.num_prefix_tokens
    roll, grad_roll, heads = [], [], []
    weighted = []
    for i, (a, g) in enumerate(zip(attns, grads)):
        a, g = a.detach(), g.detach()
        roll.append(token_map(rollout([x_.mean(1) for x_ in attns[: i + 1]], num_prefix_tokens=p), grid, p)[0])
        w = (a * g).clamp(min=0).mean(1)
        weighted.append(w / w.sum(-1, keepdim=True).clamp(min=1e-12))
        grad_roll.append(token_map(rollout(weighted, num_prefix_tokens=p), grid, p)[0])
        rows = a[0, :, 0, p:] if p else a[0, :, p:, p:].mean(1)  # (H, N)
        rows = rows / rows.amax(-1, keepdim=True).clamp(min=1e-12)
        heads.append(rows.reshape(rows.shape[0], *grid))

    def as_list(t: torch.Tensor) -> list:
        return [[round(float(v), 4) for v in row] for row in t.tolist()]

    return {"grid": list(grid), "class_index": idx, "layers": len(attns), "heads": c.num_heads,
            "rollout": [as_list(m) for m in roll], "grad_rollout": [as_list(m) for m in grad_roll],
            "head_maps": [[as_list(h) for h in layer] for layer in heads]}


def overlay_png(shown: np.ndarray, heat: list | np.ndarray) -> bytes:
    """The image with a heat map over it, as PNG bytes."""
    h = upsample(torch.tensor(np.asarray(heat, dtype=np.float32)), shown.shape[:2])
    rgb = (overlay(shown, h) * 255).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]
