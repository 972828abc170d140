"""A/B of the MLP's GELU fused into oneDNN's GEMM (`Linear.forward_act`) against the separate GELU op, interleaved
in one process (4 rounds of 1 s each way, the best of each):

    python benchmarks/gelu_fusion_ab.py vit_s16 bf16 8
"""
import sys
import time
import torch
import vitkit
from vitkit.bench import make_step
from vitkit.machine.fast_linear import FastGemm
from vitkit.machine.cpu import cpu_model
orig = FastGemm._linear_act
model, dtype, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
m = vitkit.create_model(model)
x = torch.randn(batch, 3, 224, 224)
step = make_step(m, x, dtype, False, False)
def rate(n=None):
    step()
    t = time.perf_counter()
    k = 0
    while time.perf_counter() - t < 1.0:
        step()
        k += 1
    return batch * k / (time.perf_counter() - t)
res = {"fused": [], "unfused": []}
for _ in range(4):
    FastGemm._linear_act = orig
    res["fused"].append(rate())
    FastGemm._linear_act = lambda *a, **k: None
    res["unfused"].append(rate())
f, u = max(res["fused"]), max(res["unfused"])
print(f"{model} {dtype} b{batch} ({cpu_model()}, {torch.get_num_threads()} threads): fused {f:.1f} unfused {u:.1f} img/s -> {f/u:.2f}x")
