"""The model runner's own forward on CPU: a Llama-family model's layers in one plain loop.

Transformers' forward of a decoder layer is a tree of module calls, decorators, output objects
and reshapes around each op: at decode's batch sizes on one CPU thread that Python costs as much
as the attention (a step of the serving bench's model: ~3000 aten ops). `OwnForward` runs the
same math over the same modules' weights with fewer ops:
- q, k and v come from one linear (their weights concatenated at load, `qkv_proj`), gate and up
  from another (`gate_up_proj`), so a layer runs four matmuls instead of seven and RoPE turns
  q and k in one pass;
- RMSNorm is `torch.nn.functional.rms_norm` (float32); residual adds and SiLU * up are in place;
- attention is computesvc.paged_attention.attend: the same fence, pool write and kernels the
  transformers hook runs.
Rotary embeddings come from the model's own `rotary_emb` module (every RoPE scaling it knows).

Only on CPU, for the model types kvtier serves (Llama, Qwen2, Mistral): on CUDA the model runs
transformers' forward with the paged attention hook (the Triton kernels' path). Fusing is in
place and once per model; the fused model then runs only under ModelRunner (its transformers
forward would look for q_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvtier.computesvc.paged_attention import PagedBatch, attend

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass
class _Layer:
    index: int
    input_norm: torch.nn.Module
    qkv: torch.nn.Module
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module
    scale: float
    window: int | None


class OwnForward:
    """The forward of a model `fuse_linears` fused: logits of the kept tokens."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.intermediate = config.intermediate_size
        self.layers = [_layer(layer, config) for layer in model.model.layers]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T] of the batch's new tokens. Returns the lm head's logits, in
        the model's dtype: of every token when `logits_to_keep` is an int (the runner passes 0),
        else of the rows that tensor indexes."""
        base = self.model.model
        heads, qk_heads, inter = self.num_heads, self.num_heads + self.num_kv_heads, self.intermediate
        hidden = base.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = base.rotary_emb(hidden, positions[None])  # [1, T, head_dim]
        cos, sin = cos[0, :, None], sin[0, :, None]
        num_tokens = hidden.shape[0]
        for layer in self.layers:
            qkv = layer.qkv(_norm(layer.input_norm, hidden)).view(num_tokens, -1, self.head_dim)
            qk = _rope(qkv[:, :qk_heads], cos, sin)
            out = attend(
                batch, layer.index, qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], layer.scale, layer.window
            )
            hidden += layer.o_proj(out.view(num_tokens, -1))
            gate_up = layer.gate_up(_norm(layer.post_norm, hidden))
            hidden += layer.down(layer.act(gate_up[:, :inter]).mul_(gate_up[:, inter:]))
        if not isinstance(logits_to_keep, int):
            hidden = hidden[logits_to_keep]
        return self.model.lm_head(_norm(base.norm, hidden))


def fuse_linears(model: PreTrainedModel) -> bool:
    """Whether `model` runs `OwnForward`: on CPU, of a type kvtier serves. Then its q/k/v and
    gate/up linears are fused in place (once: a second call finds them fused). Make the
    `OwnForward` after any other swap of the model's linears (it holds the modules it finds)."""
    if next(model.parameters()).device.type != "cpu" or model.config.model_type not in SUPPORTED:
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):
            attn.qkv_proj = _fuse(attn, ("q_proj", "k_proj", "v_proj"))
        if not hasattr(mlp, "gate_up_proj"):
            mlp.gate_up_proj = _fuse(mlp, ("gate_proj", "up_proj"))
    return True


def is_fused(model: PreTrainedModel) -> bool:
    """Whether `fuse_linears` fused this model (its transformers forward no longer runs)."""
    return any(hasattr(layer.self_attn, "qkv_proj") for layer in getattr(model.model, "layers", ()))


def _fuse(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Linear:
    """One linear computing `names`' outputs side by side; the originals are removed."""
    parts = [getattr(parent, name) for name in names]
    weight = torch.cat([part.weight for part in parts])
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=any(p.bias is not None for p in parts))
    fused = fused.to(weight.device, weight.dtype).requires_grad_(False)
    fused.weight.copy_(weight)
    if fused.bias is not None:
        biases = [p.bias if p.bias is not None else weight.new_zeros(p.out_features) for p in parts]
        fused.bias.copy_(torch.cat(biases))
    for name in names:
        delattr(parent, name)
    return fused


def _layer(layer: torch.nn.Module, config) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    # Qwen2 sets each layer's window (None on full-attention layers); Mistral reads its config's.
    window = (
        attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    )
    return _Layer(
        index=attn.layer_idx,
        input_norm=layer.input_layernorm,
        qkv=attn.qkv_proj,
        o_proj=attn.o_proj,
        post_norm=layer.post_attention_layernorm,
        gate_up=mlp.gate_up_proj,
        down=mlp.down_proj,
        act=mlp.act_fn,
        scale=attn.scaling,
        window=int(window) if window else None,
    )


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (fp32 math, the weight applied after the cast back); in float32
    torch's rms_norm computes the same in fewer ops."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding (rotate-half form) of x [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return rotated.add_(x * cos)  # (x * cos) + (rotated * sin), each rounded as transformers does
