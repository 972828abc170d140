"""The hybrid backbone's input layout on this CPU (NOTES section 23): channels-last (what PatchEmbed does) against
NCHW, forward and forward+backward of the fashion-mnist preset's ResNet stem and bottlenecks on RGB 56-px images at
batch 64 (one channel would make the two layouts the same memory), median of 5 interleaved rounds. Run it as is and
under the AVX2 caps (benchmarks/isa.py names them)."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import vitkit
    from vitkit.machine.cpu import cpu_model
    from vitkit.training import get_preset

    cfg = get_preset("fashion-mnist")
    m = vitkit.create_model(cfg.model.name, num_classes=10, img_size=56, in_chans=3, **cfg.model.overrides)
    backbone = m.patch_embed.backbone
    x = torch.randn(64, 3, 56, 56)
    print(f"{cpu_model()}, ATen {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    for train in (False, True):
        fns = {}
        for name, fmt in (("channels-last", torch.channels_last), ("NCHW", torch.contiguous_format)):
            def go(fmt=fmt):
                with torch.set_grad_enabled(train):
                    y = backbone(x.contiguous(memory_format=fmt))
                    if train:
                        y.sum().backward()
            fns[name] = go
        times = {k: [] for k in fns}
        for r in range(5):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                fns[k]()
                t = time.perf_counter()
                for _ in range(3):
                    fns[k]()
                times[k].append((time.perf_counter() - t) / 3 * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{'fwd+bwd' if train else 'fwd':>7}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items())
              + f"; NCHW / channels-last {med['NCHW'] / med['channels-last']:.2f}x")


if __name__ == "__main__":
    main()
