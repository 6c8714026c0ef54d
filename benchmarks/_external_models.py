"""Transformers written outside this project, for the cost benchmarks: a Hugging Face GPT-2 built offline
from its config (eager or SDPA attention), a nanoGPT-style model whose attention is
``F.scaled_dot_product_attention(is_causal=True)``, and a bidirectional masked-token model on PyTorch's
``nn.TransformerEncoder``. All 6 layers × 384 wide (6 heads) by default."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 512


def gpt2(
    context: int, layers: int = 6, width: int = 384, heads: int = 6, attention: str = "sdpa"
) -> nn.Module:
    """A freshly initialised Hugging Face ``GPT2LMHeadModel`` (no download), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attention,
    )
    return GPT2LMHeadModel(config)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.mlp(self.norm2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model, minus dropout and weight tying: learned positions, pre-norm blocks, SDPA."""

    def __init__(self, context: int, layers: int = 6, width: int = 384, heads: int = 6) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        for name, parameter in self.named_parameters():
            if parameter.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(parameter, std=std)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Encoder(nn.Module):
    """A BERT-style masked-token model on ``nn.TransformerEncoder``: learned positions, pre-norm layers,
    dropout off, every matrix initialised with standard deviation 0.02."""

    def __init__(self, context: int, layers: int = 6, width: int = 384, heads: int = 6) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB + 1, width)  # the last id masks a token
        self.positions = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        for parameter in self.parameters():
            if parameter.ndim == 2:
                nn.init.normal_(parameter, std=0.02)

    def embed(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.tokens(input_ids) + self.positions(positions)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.norm(self.encoder(self.embed(input_ids))))


MASKED_FRACTION = 0.15


def masked(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(input ids with a fixed 15% of the positions replaced by the mask id, those positions)."""
    generator = torch.Generator().manual_seed(1)
    chosen = (torch.rand(tokens.shape, generator=generator) < MASKED_FRACTION).to(tokens.device)
    return torch.where(chosen, torch.full_like(tokens, VOCAB), tokens), chosen


def model_and_loss(name: str, context: int, layers: int = 6, attention: str = "sdpa"):
    """(model, loss_of(model, tokens)) for ``name`` "gpt2" or "nanogpt" (next-token cross-entropy) or
    "encoder" (cross-entropy of the masked tokens)."""
    if name == "gpt2":
        model = gpt2(context, layers, attention=attention)

        def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
            return model(input_ids=tokens, labels=tokens).loss

    elif name == "nanogpt":
        model = NanoGPT(context, layers)

        def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
            logits = model(tokens)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    elif name == "encoder":
        model = Encoder(context, layers)

        def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
            inputs, chosen = masked(tokens)
            return F.cross_entropy(model(inputs)[chosen], tokens[chosen])

    else:
        raise ValueError(f"model must be 'gpt2', 'nanogpt' or 'encoder', got {name!r}")
    return model, loss_of


def token_batch(batch: int, context: int, seed: int = 0, device: str = "cpu") -> Tensor:
    """Token ids with structure to learn (a repeated random pattern), so that training moves attention."""
    generator = torch.Generator().manual_seed(seed)
    period = 16
    pattern = torch.randint(0, VOCAB, (batch, period), generator=generator)
    tokens = pattern.repeat(1, context // period + 1)[:, :context]
    noise = torch.rand(tokens.shape, generator=generator) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=generator), tokens)
    return tokens.to(device)


@torch.no_grad()
def eager_attention_probabilities(model: nn.Module, tokens: Tensor) -> list[Tensor]:
    """Each layer's attention probabilities (batch, heads, n, n) from an eager forward, as a user would get
    them by hand: ``output_attentions=True`` for GPT-2, the softmax written out for the nanoGPT model,
    ``need_weights=True`` for the encoder's layers."""
    if isinstance(model, Encoder):
        probabilities = []
        x = model.embed(masked(tokens)[0])
        for layer in model.encoder.layers:
            normed = layer.norm1(x)
            attended, probs = layer.self_attn(
                normed, normed, normed, need_weights=True, average_attn_weights=False
            )
            probabilities.append(probs)
            x = x + attended
            x = x + layer.linear2(layer.activation(layer.linear1(layer.norm2(x))))
        return probabilities
    if isinstance(model, NanoGPT):
        probabilities = []
        n = tokens.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        x = model.tokens(tokens) + model.positions(torch.arange(n, device=tokens.device))
        for block in model.blocks:
            batch, _, width = x.shape
            q, k, v = block.qkv(block.norm1(x)).split(width, dim=2)
            q, k, v = (t.view(batch, n, block.heads, -1).transpose(1, 2) for t in (q, k, v))
            logits = (q @ k.mT / math.sqrt(q.shape[-1])).masked_fill(~causal, float("-inf"))
            probs = logits.softmax(dim=-1)
            probabilities.append(probs)
            x = x + block.proj((probs @ v).transpose(1, 2).reshape(batch, n, width))
            x = x + block.mlp(block.norm2(x))
        return probabilities
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return list(model(input_ids=tokens, output_attentions=True).attentions)
    finally:
        model.set_attn_implementation(implementation)
