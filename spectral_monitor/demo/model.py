"""A tiny transformer to watch: pre-LN blocks whose attention can scale its logits with the context length.

Read top to bottom: a block, the model with its training step, the Lightning module. The attention is the
public :class:`spectral_monitor.toolbox.LengthScaledAttention` (its module docstring says why logits may
scale with γ·log n); the demo uses it as any user would.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spectral_monitor.lightning.namespaces import pl
from spectral_monitor.toolbox.length_scaling import (
    LengthScaledAttention,
    LogitScaling,
    QKNorm,
    attention_logit_scale,
)

__all__ = [
    "IGNORE_INDEX",
    "Block",
    "DemoTransformer",
    "DemoTransformerMixin",
    "LengthScaledAttention",
    "attention_logit_scale",
]

IGNORE_INDEX = -100
"""Target of a position that carries no loss (the default ``ignore_index`` of ``F.cross_entropy``)."""


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x)).

    Args:
        d_model: Residual-stream width.
        n_heads: Attention heads; must divide ``d_model``.
        causal: Whether query i attends only keys j <= i.
        dropout: Dropout on attention weights, attention output and MLP output.
        logit_scaling: That of :func:`attention_logit_scale`.
        log_n_gamma: γ of ``"log_n"``.
        train_seq_len: n_train of the relative ``"log_n"`` form.
        qk_norm: ``"none"``, ``"layer"`` or ``"rms"``, as :class:`LengthScaledAttention` takes it.

    Examples:
        >>> import torch
        >>> block = Block(16, 2, causal=True, dropout=0.0, logit_scaling="standard", log_n_gamma=None,
        ...               train_seq_len=None)
        >>> block(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool,
        dropout: float,
        logit_scaling: LogitScaling,
        log_n_gamma: float | None,
        train_seq_len: int | None,
        qk_norm: QKNorm = "none",
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = LengthScaledAttention(
            d_model, n_heads, causal, dropout, logit_scaling, log_n_gamma, train_seq_len, qk_norm
        )
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the block.

        Args:
            x: The residual stream, (batch, n, d_model).

        Returns:
            The stream after the block, the shape of ``x``.
        """
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DemoTransformerMixin(nn.Module):
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
        warmup_steps: raise the learning rate linearly from lr/warmup_steps to lr over this many optimizer
            steps, then hold it (0: constant from the first step).
        logit_scaling: ``"standard"`` (1/√d_k) or ``"log_n"`` (γ·log n/√d_k), see
            :func:`attention_logit_scale`.
        log_n_gamma: γ of ``"log_n"`` (None: 1.0).
        train_seq_len: with ``"log_n"``, use the relative form γ·log n/log n_train.
        qk_norm: ``"none"``, or normalise each head's q and k before their dot product with ``"layer"``
            (LayerNorm) or ``"rms"`` (RMSNorm), learned gain initialised to 1: QK-norm, which keeps attention
            logits bounded at learning rates where they would otherwise grow until the loss spikes.
        init_std: standard deviation of the weight matrices and embeddings at initialisation (GPT-2's 0.02
            by default; projections into the residual stream get init_std/√(2·n_layers)). Attention
            logits then have a standard deviation of about ``init_std² · d_model``, times γ·log n with
            ``"log_n"``.
        seed: seed of the initialisation.

    Everything of the demo model but its Lightning base: :class:`DemoTransformer` adds
    ``pytorch_lightning.LightningModule``, :class:`spectral_monitor.demo.lightning_pytorch.DemoTransformer`
    ``lightning.pytorch.LightningModule``.

    Raises:
        ValueError: A size is below 1, ``lr`` or ``init_std`` is not positive, ``weight_decay`` is
            negative, or ``warmup_steps`` is not an int >= 0.

    Examples:
        >>> import torch
        >>> model = DemoTransformer(d_model=16, n_layers=1, n_heads=2, seq_len=8)
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 160])
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
        warmup_steps: int = 0,
        logit_scaling: LogitScaling = "standard",
        log_n_gamma: float | None = None,
        train_seq_len: int | None = None,
        qk_norm: QKNorm = "none",
        init_std: float = 0.02,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("seq_len", seq_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not init_std > 0:
            raise ValueError(f"init_std must be > 0, got {init_std!r}")
        self.save_hyperparameters()

        # The default initialisers below draw from the global RNG; they are all overwritten by
        # `_initialise`, so run them on a forked RNG and leave the caller's stream untouched.
        with torch.random.fork_rng(devices=[]):
            self.token_embedding = nn.Embedding(vocab_size, d_model)
            self.position_embedding = nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(
                Block(d_model, n_heads, causal, dropout, logit_scaling, log_n_gamma, train_seq_len, qk_norm)
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
        """Logits over the vocabulary at every position.

        Args:
            tokens: Token ids, (batch, n) with n at most ``seq_len``.

        Returns:
            The logits, (batch, n, vocab_size).

        Raises:
            ValueError: ``tokens`` has more than ``seq_len`` positions.
        """
        n = tokens.shape[1]
        if n > self.hparams.seq_len:
            raise ValueError(f"tokens has {n} positions; the model has seq_len={self.hparams.seq_len}")
        positions = torch.arange(n, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The cross-entropy over the positions with a target; logs it and the accuracy there.

        Args:
            batch: ``(tokens, targets)``, both (batch, n).
            batch_idx: The batch's index (unused).

        Returns:
            The loss.
        """
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        answered = targets != IGNORE_INDEX
        accuracy = (logits.argmax(-1)[answered] == targets[answered]).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", accuracy, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        """AdamW, with weight decay on matrices and embeddings only, and the linear warmup if any.

        Returns:
            The optimizer, or with ``warmup_steps`` a dict of it and its per-step schedule.
        """
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": self.hparams.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
        warmup = self.hparams.warmup_steps
        if warmup == 0:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class DemoTransformer(DemoTransformerMixin, pl.LightningModule):
    """:class:`DemoTransformerMixin` (arguments in its docstring) as a ``pytorch_lightning`` module, or a
    ``lightning.pytorch`` one where only that is installed; for ``lightning.pytorch`` next to
    ``pytorch_lightning``, :class:`spectral_monitor.demo.lightning_pytorch.DemoTransformer`.

    Examples:
        >>> model = DemoTransformer(d_model=16, n_layers=1, n_heads=2, seq_len=8, warmup_steps=10)
        >>> type(model.configure_optimizers()["optimizer"]).__name__
        'AdamW'
    """
