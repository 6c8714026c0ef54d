"""A tiny transformer to watch: pre-LN blocks whose attention can scale its logits with the context length.

Read top to bottom: the logit scale, the attention that uses it, a block, the Lightning module.

Why length-scaled logits. Softmax over n keys whose logits stay O(1) flattens as n grows: a key that beats
the others by a fixed margin Δ gets weight e^Δ/(e^Δ + n − 1), which falls toward 0, so at long context the
rows drift toward uniform attention, which without a mask is rank one (Chiang & Cholak 2022,
"Overcoming a theoretical limitation of self-attention"; Nakanishi 2025, "Scalable-Softmax").
Multiplying the logits by γ·log n turns that weight into n^{γΔ}/(n^{γΔ} + n − 1), which does not
vanish once γΔ ≥ 1. Every attention call goes through ``torch.nn.functional.scaled_dot_product_attention``
with the scale passed explicitly, so whatever captures the kernel's inputs (the monitor does) sees
exactly the scale that was used.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

LogitScaling = Literal["standard", "log_n"]

IGNORE_INDEX = -100
"""Target of a position that carries no loss (the default ``ignore_index`` of ``F.cross_entropy``)."""


def _check_logit_scaling(
    logit_scaling: str, log_n_gamma: float | None, train_seq_len: int | None
) -> None:
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

    - ``"standard"``: 1/√d_k.
    - ``"log_n"``: γ·log n/√d_k (γ = ``log_n_gamma``, 1.0 if None).
    - ``"log_n"`` with ``train_seq_len``: γ·(log n/log n_train)/√d_k, the relative form, which equals
      γ/√d_k at the training length and grows only when the context does.

    n is the number of keys of the call; under a causal mask it is the longest row's.
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

    With ``logit_scaling="standard"`` it is ordinary scaled dot-product attention.
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
    ) -> None:
        super().__init__()
        if n_heads < 1 or d_model % n_heads != 0:
            raise ValueError(f"n_heads must be >= 1 and divide d_model={d_model}, got {n_heads!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        _check_logit_scaling(logit_scaling, log_n_gamma, train_seq_len)
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.causal = causal
        self.dropout = dropout
        self.logit_scaling = logit_scaling
        self.log_n_gamma = log_n_gamma
        self.train_seq_len = train_seq_len
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.output = nn.Linear(d_model, d_model)
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, d_model = x.shape
        # (batch, n, 3·d) -> three (batch, heads, n, head_dim)
        q, k, v = self.qkv(x).view(batch, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
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


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool,
        dropout: float,
        logit_scaling: LogitScaling,
        log_n_gamma: float | None,
        train_seq_len: int | None,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = LengthScaledAttention(
            d_model, n_heads, causal, dropout, logit_scaling, log_n_gamma, train_seq_len
        )
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DemoTransformer(pl.LightningModule):
    """A small token-level transformer: token + learned position embeddings, pre-LN blocks, a linear head.

    It predicts a target at every position (``IGNORE_INDEX`` where there is none), so one model serves
    causal and bidirectional tasks. The weights are drawn from a generator seeded with ``seed``: the same
    arguments give the same model whatever the global RNG holds, and building it leaves that RNG alone.

    Args:
        vocab_size: number of token ids in inputs and targets.
        d_model: residual-stream width.
        n_layers: number of blocks.
        n_heads: attention heads per block; must divide ``d_model``.
        seq_len: longest input; sets the number of learned positions.
        causal: mask future keys (True) or attend both ways (False).
        dropout: dropout on attention weights, attention output and MLP output.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only.
        logit_scaling: ``"standard"`` (1/√d_k) or ``"log_n"`` (γ·log n/√d_k), see
            :func:`attention_logit_scale`.
        log_n_gamma: γ of ``"log_n"`` (None: 1.0).
        train_seq_len: with ``"log_n"``, use the relative form γ·log n/log n_train.
        init_std: standard deviation of the weight matrices and embeddings at initialisation (GPT-2's 0.02
            by default; projections into the residual stream get init_std/√(2·n_layers)). Attention
            logits then have a standard deviation of about ``init_std² · d_model``, times γ·log n with
            ``"log_n"``.
        seed: seed of the initialisation.
    """

    def __init__(
        self,
        vocab_size: int = 160,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        causal: bool = True,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        logit_scaling: LogitScaling = "standard",
        log_n_gamma: float | None = None,
        train_seq_len: int | None = None,
        init_std: float = 0.02,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("seq_len", seq_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not init_std > 0:
            raise ValueError(f"init_std must be > 0, got {init_std!r}")
        self.save_hyperparameters()

        # The default initialisers below draw from the global RNG; they are all overwritten by
        # `_initialise`, so run them on a forked RNG and leave the caller's stream untouched.
        with torch.random.fork_rng(devices=[]):
            self.token_embedding = nn.Embedding(vocab_size, d_model)
            self.position_embedding = nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(
                Block(d_model, n_heads, causal, dropout, logit_scaling, log_n_gamma, train_seq_len)
                for _ in range(n_layers)
            )
            self.final_norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab_size)
        self._initialise(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def _initialise(self, generator: torch.Generator) -> None:
        std = self.hparams.init_std
        for name, parameter in self.named_parameters():
            if parameter.dim() < 2:  # biases and LayerNorm: zero shift, unit gain
                parameter.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            elif name.endswith(("attention.output.weight", "mlp.2.weight")):
                # Projections that write into the residual stream: GPT-2 divides by √(2·n_layers) so
                # the stream's variance does not grow with depth.
                parameter.normal_(0.0, std / math.sqrt(2 * self.hparams.n_layers), generator=generator)
            else:
                parameter.normal_(0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary at every position, shape (batch, n, vocab_size)."""
        n = tokens.shape[1]
        if n > self.hparams.seq_len:
            raise ValueError(f"tokens has {n} positions; the model has seq_len={self.hparams.seq_len}")
        positions = torch.arange(n, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        answered = targets != IGNORE_INDEX
        accuracy = (logits.argmax(-1)[answered] == targets[answered]).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", accuracy, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": self.hparams.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
