"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

The forward pass works on a flat batch: T tokens from any mix of prefill chunks and decodes,
described by `AttentionMetadata`. Per layer: fused qkv projection -> `ops.rotary_store_kv`
(rotates q/k, writes k/v into the layer's cache) -> `ops.paged_attention` (reads all context
from the cache) -> o_proj; residual add + RMSNorm through `ops.rms_norm`; gated MLP through
`ops.silu_and_mul`. Parameters are created uninitialised: the loader fills every one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.linear import pack_weight
from sluice.kernels.ops import Ops
from sluice.workers.model.config import ModelConfig, RopeConfig


class Linear(nn.Module):
    """y = x W^T (+ b) with uninitialised storage; `out_features` may be a fused concatenation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        # The backend's pre-packed copy of `weight` (kernels/linear.py), made by `pack()` once the
        # weight is loaded; None: the plain weight is used.
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.packed)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with linear or llama3 scaling applied (HF semantics)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def build_cos_sin_cache(rope: RopeConfig, head_dim: int, max_position: int,
                        device: torch.device) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first half, sin in the second (kernels/rotary.py)."""
    inv_freq = rope_inv_freq(rope, head_dim)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]; same products as HF's matmul
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class RopeInputs(NamedTuple):
    """What every layer's rotary step needs: the positions [T] and the [P, D] cos/sin table (the
    Triton kernel reads them), and the rows of the positions, gathered once a step (`Ops.rope_rows`;
    None on the Triton backend)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rows: tuple[torch.Tensor, torch.Tensor] | None


class RMSNormWeight(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        # qkv_proj rows: [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, device)
        self.eps = cfg.rms_norm_eps
        self.q_norm = RMSNormWeight(cfg.head_dim, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNormWeight(cfg.head_dim, dtype, device) if cfg.qk_norm else None

    def forward(self, ops: Ops, x: torch.Tensor, rope: RopeInputs, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(ops, x)  # [T, (Hq + 2 * Hkv) * D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            # Qwen3: per-head RMSNorm, run as rows of [T * H, D] through the same fused op.
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps)[0].view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps)[0].view_as(k)
            q, _ = ops.rotary_store_kv(q, k, v, rope.positions, rope.cos_sin_cache, k_cache, v_cache,
                                       meta.slot_mapping, rope.rows)
        else:  # one op on the fused projection (one native call on the CPU)
            q = ops.qkv_rotary_store_kv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.positions,
                                        rope.cos_sin_cache, k_cache, v_cache, meta.slot_mapping, rope.rows)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj.forward(ops, out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # gate_up_proj rows: [gate (I) | up (I)], the layout ops.silu_and_mul expects.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(ops, ops.silu_and_mul(self.gate_up_proj.forward(ops, x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # residual carries the un-normalised stream; rms_norm adds it in before normalising.
        h, residual = ops.rms_norm(x, self.input_layernorm.weight, self.eps, residual)
        h = self.self_attn.forward(ops, h, rope, k_cache, v_cache, meta)
        h, residual = ops.rms_norm(h, self.post_attention_layernorm.weight, self.eps, residual)
        return self.mlp.forward(ops, h), residual


class LlamaForCausalLM(nn.Module):
    """Our Llama/Mistral/Qwen2 model. `forward` returns hidden states; `compute_logits` the head."""

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
                 max_position: int) -> None:
        super().__init__()
        self.config, self.ops = cfg, ops
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, dtype, device)
        self.lm_head: nn.Parameter | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._packed_head: torch.Tensor | None = None
        # Rope tables stay float32 whatever the weight dtype, as HF computes them.
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(cfg.rope, cfg.head_dim, max_position, device),
                             persistent=False)

    def pack_weights(self) -> None:
        """Pre-pack every projection and the head for the backend's matmul (a no-op where it has
        no packed form). Call after the weights are loaded and again if they are ever changed."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self._packed_head = pack_weight(self.embed_tokens if self.lm_head is None else self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final normalised hidden states [T, H]."""
        x = F.embedding(input_ids, self.embed_tokens)
        self.ops.begin_step(x, kv_caches[0][0].dtype)
        residual: torch.Tensor | None = None
        rope = RopeInputs(positions, self.cos_sin_cache, self.ops.rope_rows(positions, self.cos_sin_cache))
        # Submodules are called through `.forward`: a decode step makes ~210 module calls, and at one
        # sequence nn.Module.__call__'s hook handling was a measurable part of the non-GEMM time
        # (the model registers no hooks; torch.compile and CUDA-graph capture trace this the same way).
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(self.ops, x, residual, rope, k_cache, v_cache, meta)
        x, _ = self.ops.rms_norm(x, self.norm.weight, self.config.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (only rows that sample) -> logits [N, V] in float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.ops.linear(hidden, head, None, self._packed_head).float()
