"""Length-aware attention: multi-head self-attention whose logit scale grows with the context length.

Why. Softmax over n keys whose logits stay O(1) flattens as n grows: a key that beats the others by a fixed
margin Δ gets weight e^Δ/(e^Δ + n − 1), which falls toward 0, so at long context the rows drift toward
uniform attention, which without a mask is rank one (Chiang & Cholak 2022, "Overcoming a theoretical
limitation of self-attention"; Nakanishi 2025, "Scalable-Softmax"). Multiplying the logits by γ·log n turns
that weight into n^{γΔ}/(n^{γΔ} + n − 1), which does not vanish once γΔ ≥ 1. The first power of log n is the
critical one (not (log n)^1.5 or (log n)^2, which over-sharpen as n grows).

The relative form γ·log n / log n_train equals γ at the training length, so a model trained with the standard
scale (γ = 1) keeps its logits there and only sharpens them on longer contexts.

QK-norm (``qk_norm="layer"`` or ``"rms"``) normalises each head's q and k over the head width, with a learned
gain, before their dot product (Dehghani et al. 2023, "Scaling vision transformers to 22 billion parameters";
Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities"). A logit is
then bounded by the norms' learned gains (and LayerNorm's biases) times the scale, however large W_Q and W_K
grow, which removes the attention-logit growth behind loss spikes at high learning rates.

Every call goes through ``torch.nn.functional.scaled_dot_product_attention`` with the scale passed explicitly,
so whatever captures the kernel's inputs (:class:`spectral_monitor.probes.AttentionCapture` does) sees exactly
the scale that was used. The demo model (:mod:`spectral_monitor.demo.model`) is built from this module.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LogitScaling", "LengthScaledAttention", "QKNorm", "attention_logit_scale"]

LogitScaling = Literal["standard", "log_n"]
"""How the attention logits are scaled: ``"standard"``, 1/√d_k; ``"log_n"``, γ·log n / √d_k at length n."""
QKNorm = Literal["none", "layer", "rms"]
"""Normalisation of each head's q and k before the logits: none, LayerNorm, or RMSNorm (learned gain each)."""


def _check_logit_scaling(logit_scaling: str, log_n_gamma: float | None, train_seq_len: int | None) -> None:
    if logit_scaling not in get_args(LogitScaling):
        raise ValueError(f"logit_scaling must be one of {get_args(LogitScaling)}, got {logit_scaling!r}")
    if logit_scaling == "standard" and (log_n_gamma is not None or train_seq_len is not None):
        raise ValueError(
            "log_n_gamma and train_seq_len only apply with logit_scaling='log_n'; "
            f"got log_n_gamma={log_n_gamma!r}, train_seq_len={train_seq_len!r}"
        )
    if log_n_gamma is not None and not log_n_gamma > 0:
        raise ValueError(f"log_n_gamma must be > 0 (or None for 1.0), got {log_n_gamma!r}")
    if train_seq_len is not None and train_seq_len < 2:
        raise ValueError(f"train_seq_len must be >= 2 (log n_train divides the scale), got {train_seq_len!r}")


def attention_logit_scale(
    head_dim: int,
    n_keys: int,
    logit_scaling: LogitScaling = "standard",
    log_n_gamma: float | None = None,
    train_seq_len: int | None = None,
) -> float:
    """The factor multiplying q·k before the softmax, for ``n_keys`` keys of width ``head_dim``.

    Args:
        head_dim: d_k, the width of a head's queries and keys.
        n_keys: n, the number of keys of the call; under a causal mask, the longest row's.
        logit_scaling: ``"standard"``, 1/√d_k; ``"log_n"``, γ·log n/√d_k, or with ``train_seq_len`` the
            relative form γ·(log n/log n_train)/√d_k, which equals γ/√d_k at the training length and grows
            only when the context does.
        log_n_gamma: γ of ``"log_n"`` (1.0 if None).
        train_seq_len: n_train of the relative ``"log_n"`` form.

    Returns:
        The scale, a float.

    Raises:
        ValueError: ``head_dim`` or ``n_keys`` is below 1, ``logit_scaling`` is neither choice,
            ``log_n_gamma`` or ``train_seq_len`` is given with ``"standard"``, ``log_n_gamma`` is not
            positive or ``train_seq_len`` is below 2.

    Examples:
        >>> attention_logit_scale(64, 1024)
        0.125
        >>> attention_logit_scale(64, 4096, "log_n", train_seq_len=1024)
        0.15
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim!r}")
    if n_keys < 1:
        raise ValueError(f"n_keys must be >= 1, got {n_keys!r}")
    _check_logit_scaling(logit_scaling, log_n_gamma, train_seq_len)
    standard = 1.0 / math.sqrt(head_dim)
    if logit_scaling == "standard":
        return standard
    gamma = 1.0 if log_n_gamma is None else log_n_gamma
    length_factor = math.log(n_keys)
    if train_seq_len is not None:
        length_factor /= math.log(train_seq_len)
    return gamma * length_factor * standard


class LengthScaledAttention(nn.Module):
    """Multi-head self-attention through SDPA, with the logit scale of :func:`attention_logit_scale`.

    With ``logit_scaling="standard"`` and ``qk_norm="none"`` it is ordinary scaled dot-product attention.
    ``qk_norm`` (one of :data:`QKNorm`) normalises q and k per head over the head width before SDPA, so the
    q and k the kernel receives, and any capture of its inputs sees, are the normalised ones.

    Args:
        d_model: The model width.
        n_heads: The number of heads, a divisor of ``d_model``.
        causal: Whether query i attends only keys j <= i.
        dropout: The attention dropout probability, in [0, 1).
        logit_scaling: That of :func:`attention_logit_scale`.
        log_n_gamma: γ of ``"log_n"``.
        train_seq_len: n_train of the relative ``"log_n"`` form.
        qk_norm: One of :data:`QKNorm`.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``, ``dropout`` is out of range, or the scaling or
            normalisation is not one of the choices.

    Examples:
        >>> import torch
        >>> attention = LengthScaledAttention(16, 4, logit_scaling="log_n", qk_norm="rms")
        >>> attention(torch.randn(2, 10, 16)).shape
        torch.Size([2, 10, 16])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = True,
        dropout: float = 0.0,
        logit_scaling: LogitScaling = "standard",
        log_n_gamma: float | None = None,
        train_seq_len: int | None = None,
        qk_norm: QKNorm = "none",
    ) -> None:
        super().__init__()
        if n_heads < 1 or d_model % n_heads != 0:
            raise ValueError(f"n_heads must be >= 1 and divide d_model={d_model}, got {n_heads!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        _check_logit_scaling(logit_scaling, log_n_gamma, train_seq_len)
        if qk_norm not in get_args(QKNorm):
            raise ValueError(f"qk_norm must be one of {get_args(QKNorm)}, got {qk_norm!r}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.causal = causal
        self.dropout = dropout
        self.logit_scaling = logit_scaling
        self.log_n_gamma = log_n_gamma
        self.train_seq_len = train_seq_len
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.output = nn.Linear(d_model, d_model)
        self.q_norm, self.k_norm = (_head_norm(qk_norm, self.head_dim) for _ in range(2))
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence.

        Args:
            x: The input, (batch, n, d_model).

        Returns:
            The attention block's output, the shape of ``x``.
        """
        batch, n, d_model = x.shape
        # (batch, n, 3·d) -> three (batch, heads, n, head_dim)
        q, k, v = self.qkv(x).view(batch, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        scale = attention_logit_scale(
            self.head_dim, n, self.logit_scaling, self.log_n_gamma, self.train_seq_len
        )
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
            scale=scale,
        )
        y = y.transpose(1, 2).reshape(batch, n, d_model)
        return self.output_dropout(self.output(y))


def _head_norm(qk_norm: QKNorm, head_dim: int) -> nn.Module:
    """The normalisation of one of q, k over the last (head width) axis; shared by the heads."""
    if qk_norm == "layer":
        return nn.LayerNorm(head_dim)
    if qk_norm == "rms":
        return nn.RMSNorm(head_dim)
    return nn.Identity()
