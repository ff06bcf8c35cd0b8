"""A small Llama written directly in PyTorch, as a user would port one, with its own parameter names (mapped to a
Hugging Face folder's by ``NAME_MAP``), the submodules it declares for attnkit.testing (``attnkit_points``) and
the values it records itself (``attnkit_record``); ``build_broken`` makes it with one deliberate bug.

Shapes: B batch, L tokens, D width, H query heads, K key/value heads, Dh head width.
"""
from __future__ import annotations

import torch.nn.functional as F

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, config: dict, scale: float, shift: int) -> None:
        super().__init__()
        d, h, k = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        self.h, self.k, self.dh, self.scale, self.shift = h, k, d // h, scale, shift
        eps = config["rms_norm_eps"]
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.wq, self.wk = nn.Linear(d, h * self.dh, bias=False), nn.Linear(d, k * self.dh, bias=False)
        self.wv, self.wo = nn.Linear(d, k * self.dh, bias=False), nn.Linear(h * self.dh, d, bias=False)
        f = config["intermediate_size"]
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def rotate(self, x: torch.Tensor, theta: float) -> torch.Tensor:
        """x (B, L, heads, Dh) rotated by position (rotate-half layout), positions from ``shift``."""
        half = self.dh // 2
        inv = theta ** -(torch.arange(0, half, dtype=torch.float32) / half)  # (Dh/2,)
        angles = (torch.arange(x.shape[1], dtype=torch.float32) + self.shift)[:, None] * inv  # (L, Dh/2)
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]  # (L, 1, Dh)
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, x: torch.Tensor, theta: float, record, i: int) -> torch.Tensor:
        b, length, _ = x.shape
        n = self.attn_norm(x)  # (B, L, D)
        q = self.rotate(self.wq(n).view(b, length, self.h, self.dh), theta)  # (B, L, H, Dh)
        k = self.rotate(self.wk(n).view(b, length, self.k, self.dh), theta)  # (B, L, K, Dh)
        record(f"layers.{i}.rotary_q", q)
        record(f"layers.{i}.rotary_k", k)
        k = k.repeat_interleave(self.h // self.k, dim=2)  # (B, L, H, Dh)
        v = self.wv(n).view(b, length, self.k, self.dh).repeat_interleave(self.h // self.k, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale  # (B, H, L, L)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (B, H, L, L)
        record(f"layers.{i}.probs", probs)
        x = x + self.wo(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, length, -1))  # (B, L, D)
        m = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


class TorchLlama(nn.Module):
    def __init__(self, config: dict, scales: list[float] | None = None, shifts: list[int] | None = None) -> None:
        super().__init__()
        n, dh = config["num_hidden_layers"], config["hidden_size"] // config["num_attention_heads"]
        scales = scales or [dh ** -0.5] * n
        shifts = shifts or [0] * n
        self.theta = config.get("rope_theta", 10000.0)
        self.embed = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.blocks = nn.ModuleList(Block(config, scales[i], shifts[i]) for i in range(n))
        self.norm = nn.RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.attnkit_record = None
        self.attnkit_points = {"embed": "embed"}
        for i in range(n):
            self.attnkit_points.update({f"layers.{i}.norm": f"blocks.{i}.attn_norm", f"layers.{i}.q": f"blocks.{i}.wq",
                                        f"layers.{i}.k": f"blocks.{i}.wk", f"layers.{i}.v": f"blocks.{i}.wv",
                                        f"layers.{i}.mlp": f"blocks.{i}.down", f"layers.{i}.resid": f"blocks.{i}"})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        record = self.attnkit_record or (lambda name, value: None)
        x = self.embed(ids)  # (B, L, D)
        for i, block in enumerate(self.blocks):
            x = block(x, self.theta, record, i)
        return self.head(self.norm(x))  # (B, L, V)


def name_map(config: dict) -> dict[str, str]:
    """This module's state-dict names -> a Hugging Face Llama folder's tensor names."""
    out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
             "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i in range(config["num_hidden_layers"]):
        out.update({f"blocks.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight" for ours, theirs in parts.items()})
    return out


def build(config: dict) -> TorchLlama:
    return TorchLlama(config)


def build_broken(config: dict) -> TorchLlama:
    """The last layer scales its scores by 1/Dh instead of 1/sqrt(Dh)."""
    n, dh = config["num_hidden_layers"], config["hidden_size"] // config["num_attention_heads"]
    return TorchLlama(config, scales=[dh ** -0.5] * (n - 1) + [1.0 / dh])


def build_shifted(config: dict) -> TorchLlama:
    """The first layer rotates every position as the next one."""
    return TorchLlama(config, shifts=[1] + [0] * (config["num_hidden_layers"] - 1))
