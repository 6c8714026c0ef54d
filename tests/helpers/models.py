"""Tiny models the test files share: a Lightning encoder on a previous-token task, a full-batch regression
for curvature runs, a model whose attention family no default registry knows, and a count of what the
monitor may leave installed on a model. The Hugging Face models are in ``helpers.hf_models``.

Each model is built from a fixed seed unless a test asks otherwise, so two instances are the same model.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

VOCAB = 16
WIDTH = 16
HEADS = 2
TOKENS = 8

EOS_LEARNING_RATE = 0.55  # 2/η ≈ 3.6, above FullBatchRegression's initial sharpness (≈ 2.3) on its task


class TinyEncoder(pl.LightningModule):
    """Embedding, two ``nn.TransformerEncoderLayer`` blocks (LayerNorm inside), optional BatchNorm, a head:
    predicts the previous token.

    ``batch_norm`` adds a ``BatchNorm1d`` over the features after the embedding, so the running statistics
    are part of what must not change; ``optimizer`` is ``"adamw"`` or ``"sgd"`` (with momentum). Initialised
    from ``torch.manual_seed(seed)``, so two instances are the same model; ``seed=None`` draws from the
    global generator as it stands.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        batch_norm: bool = False,
        optimizer: str = "adamw",
        vocab: int = VOCAB,
        width: int = WIDTH,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.optimizer_name = optimizer
        self.embedding = nn.Embedding(vocab, width)
        self.batch_norm = nn.BatchNorm1d(width) if batch_norm else None
        block = nn.TransformerEncoderLayer(
            width, HEADS, dim_feedforward=32, dropout=dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(block, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states = self.embedding(tokens)
        if self.batch_norm is not None:
            states = self.batch_norm(states.transpose(1, 2)).transpose(1, 2)
        return self.head(self.encoder(states))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def previous_token_batches(batches: int = 8, batch_size: int = 4) -> DataLoader:
    """Random tokens (seed 0) and, as targets, the same tokens shifted one to the right."""
    tokens = torch.randint(VOCAB, (batches * batch_size, TOKENS), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=batch_size)


class FullBatchRegression(pl.LightningModule):
    """A 3-layer tanh network fitting a random teacher with MSE, trained by plain gradient descent."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.log("train/loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=EOS_LEARNING_RATE)


def teacher_data() -> DataLoader:
    """64 inputs (seed 0) and a random tanh teacher's outputs, in one batch: full-batch gradient descent."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        y = 3 * teacher(x)
    return DataLoader(TensorDataset(x, y), batch_size=64)


def hook_count(model: nn.Module) -> int:
    """Forward hooks on ``model`` and globally, plus active torch-function modes."""
    module_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    module = nn.modules.module
    global_hooks = len(module._global_forward_hooks) + len(module._global_forward_pre_hooks)
    return module_hooks + global_hooks + torch._C._len_torch_function_stack()


class FusedHeadsAttention(nn.Module):
    """Self-attention of a family no default registry knows: q, k and v in one fused ``Wqkv``, per head
    interleaved ([W_Q^h; W_K^h; W_V^h] for each head h, as its forward views them), and the head count
    under a name of its own, ``n_q_heads``."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.n_q_heads = heads
        self.Wqkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        per_head = self.Wqkv(x).view(batch, tokens, self.n_q_heads, 3, width // self.n_q_heads)
        q, k, v = per_head.permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, width))


class FusedHeadsModel(nn.Module):
    """Embedding, one :class:`FusedHeadsAttention` at ``blocks.0.attn`` with a residual connection, a head.

    Its forward takes the padding as ``pad_mask`` (batch, tokens), True at padding: a keyword no default
    registry reads. The attention ignores it, so padded queries change every attention metric that counts
    them.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": FusedHeadsAttention()})])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = x + block["attn"](x)
        return self.head(x)
