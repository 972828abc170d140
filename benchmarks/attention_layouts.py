"""Forward + backward time of attention layouts at a small ViT's size (see NOTES.md, section 1)."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
B, T, D, H = 256, 49, 128, 4
hd = D // H
x = torch.randn(B, T, D, requires_grad=True)
W, P = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)


def permute_unbind(x):
    q, k, v = W(x).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
    return P(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


def transpose_views(x):
    q, k, v = W(x).view(B, T, 3, H, hd).unbind(2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return P(o.transpose(1, 2).reshape(B, T, D))


def explicit(x):
    q, k, v = W(x).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
    return P((((q * hd**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def math_backend(x):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return permute_unbind(x)


for f in (permute_unbind, transpose_views, explicit, math_backend) * 2:
    for _ in range(3):
        f(x).sum().backward()
    t = time.perf_counter()
    for _ in range(10):
        f(x).sum().backward()
    print(f"{f.__name__:<16} {(time.perf_counter() - t) / 10 * 1000:6.1f} ms forward + backward")
