"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"): SGD with Nesterov momentum whose update for each
hidden weight matrix is replaced by the nearest semi-orthogonal matrix, computed by a few Newton-Schulz iterations;
AdamW for everything else (the input layer, the head, norms, biases, the learned tokens and embeddings).

A conv weight (C_out, C_in, kh, kw) is orthogonalised as the (C_out, C_in * kh * kw) matrix it multiplies, as in
Keller Jordan's CIFAR-10 runs. The step size of a matrix is scaled by 0.2 * sqrt(max(rows, cols)) (Moonshot's
"match RMS of AdamW", Liu et al. 2025), so that the peak learning rate and weight decay of an AdamW recipe carry over.

`torch.optim.Muon` exists since torch 2.9, but takes 2-D parameters only and leaves the rest to a second optimizer;
one optimizer with both halves keeps vitkit's learning-rate schedule, gradient clipping, checkpoints and exact resume
as they are for AdamW.
"""
from __future__ import annotations

import math

import torch

# the quintic iteration's coefficients (Keller Jordan's): maximises the slope at 0, converges to singular values in
# about [0.7, 1.2] in 5 steps, which trains as well as the exact polar factor
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The Newton-Schulz approximation of U V^T for g = U S V^T, for a matrix (rows, cols) in fp32."""
    a, b, c = NS_COEFFS
    x = g / (g.norm() + eps)  # singular values <= 1
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T  # (rows, cols) -> (cols, rows): x @ x.T is the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.T  # (m, m), m = min(rows, cols)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups with `muon=True`, AdamW for the others (`betas`, `eps`), one optimizer.

    Args:
        params: parameter groups; a group's "muon" key picks the update (default False: AdamW).
        lr: the peak learning rate of both halves (a matrix's step is lr * 0.2 * sqrt(max(rows, cols))).
        weight_decay: decoupled, as AdamW's, for both halves (a group's own value wins).
        momentum, nesterov, ns_steps: Muon's (0.95, True, 5).
        betas, eps: AdamW's.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (isinstance(ns_steps, int) and 1 <= ns_steps < 100):
            raise ValueError(f"ns_steps must be an integer in [1, 100), got {ns_steps!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not (lr >= 0.0 and weight_decay >= 0.0 and eps > 0.0):
            raise ValueError(f"lr and weight_decay must be >= 0 and eps > 0, got {lr}, {weight_decay}, {eps}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=tuple(betas), eps=eps, muon=False)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if group["muon"] and p.ndim < 2:
                raise ValueError(f"Muon updates matrices and conv kernels; got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.float()
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            elif state["momentum_buffer"].dtype != torch.float32:  # load_state_dict casts state to a bf16 param's dtype
                state["momentum_buffer"] = state["momentum_buffer"].float()
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)  # buf = mu * buf + (1 - mu) * g
            g = g.lerp(buf, mu) if group["nesterov"] else buf
            rows = g.shape[0]
            cols = g.numel() // rows
            update = orthogonalize(g.reshape(rows, cols), group["ns_steps"]).reshape(p.shape)  # conv: (C_out, -1)
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))

    def _adamw(self, group: dict) -> None:
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            if wd:
                p.mul_(1 - lr * wd)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
