"""The model's linears on CPU over oneDNN-prepacked weights, as vLLM's CPU engine runs them.

`pack_linears` swaps every `nn.Linear` of a float32 model on CPU for a `PackedLinear`, whose
weight oneDNN has reordered once, at load, into its blocked layout; each forward then calls
oneDNN's matmul on it (`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU freezing
pass emits for the same job). A plain `F.linear` goes to MKL's sgemm, which re-reads the row-major
weight every call: at decode's batch sizes (5 to 64 rows) the packed matmul took 20-40% less time
for the serving bench's model (bench/README.md, "Compute against vLLM's CPU engine"). The batch
size given at packing is only a hint; any number of rows runs. The results differ from F.linear's
by float rounding only (a different summation order).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvtier.compute")

# The row count oneDNN's packed layout is tuned for (any count runs): a decode batch.
BATCH_HINT = 16


class PackedLinear(torch.nn.Module):
    """`linear`'s function over its weight prepacked by oneDNN (inference only: no gradient).

    The packed weight is a copy in oneDNN's own layout (an opaque `torch._mkldnn` tensor, kept
    as a plain attribute: it never travels with the state dict); the original weight is
    dropped with the `nn.Linear` it came from unless something else holds it (tied embeddings)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def can_pack(model: torch.nn.Module) -> bool:
    """Whether `model`'s linears can run prepacked: float32 on CPU with oneDNN built in."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every `nn.Linear` of `model` for a `PackedLinear`, in place, when `can_pack`; returns
    how many were swapped (0 when it cannot)."""
    if not can_pack(model):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    if swaps:
        log.info("%d linears run on oneDNN-prepacked weights", len(swaps))
    return len(swaps)
