"""The output head, and the loss without the full logits (``trainer.loss_chunk``).

``Head`` is the model's output layer: called with the hidden states alone it is ``nn.Linear``
(the logits); called with the targets and a chunk size it returns the micro-batch's
[sum of next-token cross entropies, count of counted targets] (``IGNORE`` targets not
counted), computing ``chunk`` tokens' logits at a time, so no more than one chunk's
(chunk, vocab) logits ever exists (at llama_1b x micro 4 x 2048 the whole fp32 logits and
their gradient are about 4 GB each).

How: a custom autograd Function that computes each chunk's gradients in forward (the
logits, their fp32 cross entropy, and its gradient with respect to the logits, then the
chunk's input gradient and its share of the weight gradient), keeping only the input's
gradient (fp32, tokens x dim) and the weight's (fp32, vocab x dim); backward scales them by
the gradient of the loss sum. Chosen over recomputing each chunk in backward
(``torch.utils.checkpoint`` per chunk) because it costs no extra FLOPs: a recompute runs the
head's forward matmul twice, about a third more head compute (~6% of llama_1b's step), for
the price of holding the weight's gradient from forward to backward (4 x vocab x dim bytes:
1 GB at llama_1b, against the 8 GB it replaces). Each chunk's ops are today's path's ops in
today's dtypes (the head's matmul in the autocast dtype when autocast is on, the cross
entropy in fp32), so in fp32 the sums and gradients equal the unchunked ones up to
summation order.

The whole computation is one call of the head module, so every engine's hooks see one use of
its parameters: FSDP1/FSDP2 and ZeRO-3 gather the weight for it in forward (and again for
backward, where it is not read), DDP's reducer and the sharded engines' gradient hooks see
the weight's gradient arrive in backward as from ``nn.Linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recipes.data import IGNORE  # a target the loss does not count


class Head(nn.Linear):
    """``Head(h)``: the logits (nn.Linear). ``Head(h, targets, chunk)``: [sum of the token
    cross entropies, count of non-IGNORE targets] (fp32), ``chunk`` tokens' logits at a time."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                chunk: int = 0) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if self.bias is not None:
            raise ValueError("the chunked loss takes a head without a bias (GPT's)")
        return chunked_loss_sums(x, self.weight, targets, chunk)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's on this device when it is on, else the
    input's (the weight's, for ``F.linear``)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def chunked_loss_sums(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      chunk: int) -> torch.Tensor:
    """[sum of ``F.cross_entropy(x @ weight.T, targets)`` over the tokens, count of the
    non-IGNORE targets] of hidden states ``x`` (..., dim) and ``targets`` (...), ``chunk``
    tokens at a time (chunk <= 0: all at once)."""
    flat, t = x.flatten(0, -2), targets.flatten()
    chunk = chunk if chunk > 0 else max(1, t.numel())
    count = (t != IGNORE).sum()
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        total = ChunkedCrossEntropy.apply(flat, weight, t, chunk)
    else:  # validation: the sums alone
        total = flat.new_zeros((), dtype=torch.float32)
        for i in range(0, t.numel(), chunk):
            logits = F.linear(flat[i:i + chunk], weight)
            total = total + F.cross_entropy(logits.float(), t[i:i + chunk], ignore_index=IGNORE,
                                            reduction="sum")
    return torch.stack([total, count.to(total.dtype)])


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over tokens of the fp32 cross entropy of ``x @ weight.T``; forward computes the
    gradients chunk by chunk and keeps them, backward scales them (see the module's text)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        dt, device = compute_dtype(x), x.device.type
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(device, enabled=False):
            w = weight.detach().to(dt)
            gx = torch.empty(x.shape, dtype=torch.float32, device=x.device) if need_x else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for i in range(0, targets.numel(), chunk):
                xc = x[i:i + chunk].detach().to(dt)
                logits = F.linear(xc, w).requires_grad_()
                with torch.enable_grad():
                    loss = F.cross_entropy(logits.float(), targets[i:i + chunk],
                                           ignore_index=IGNORE, reduction="sum")
                (dl,) = torch.autograd.grad(loss, logits)  # in dt, as the head's backward sees it
                del logits
                total += loss.detach()
                if need_x:
                    gx[i:i + chunk] = dl @ w
                if need_w:
                    if dt == gw.dtype:
                        gw.addmm_(dl.t(), xc)
                    else:
                        gw += dl.t() @ xc
        ctx.grads = [gx, gw]
        ctx.dtypes = (x.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.grads is None:
            raise RuntimeError("the chunked loss's backward ran twice (retain_graph): its "
                               "gradients were computed once, in forward")
        (gx, gw), ctx.grads = ctx.grads, None
        gx = None if gx is None else gx.mul_(grad).to(ctx.dtypes[0])
        gw = None if gw is None else gw.mul_(grad).to(ctx.dtypes[1])
        return gx, gw, None, None
