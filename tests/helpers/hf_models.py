"""Tiny Hugging Face models built offline, one factory per family: GPT-2, LLaMA, Mistral, BERT, DistilBERT
and T5.

Each factory owns its family's defaults (two layers of width 32 with four heads, a vocabulary of 64, 32
positions, special token ids inside that vocabulary, no dropout, ``sdpa`` attention, seed 0) and takes any
other config key as a keyword, so a test states only what it changes:
``tiny_gpt2(head="causal_lm", attention="eager", n_embd=16, vocab_size=40)``. ``dropout`` sets every
dropout key of the family (their names differ per family). ``seed`` seeds the global generator just before
the model is built, so two calls give the same model; ``seed=None`` draws from the generator as it stands,
for a test that seeds once and builds several models. The test is skipped without ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn


@dataclass(frozen=True)
class _Family:
    config: str  # the transformers config class
    heads: dict[str | None, str]  # head -> the transformers model class; None: the model without a head
    defaults: dict[str, Any]
    dropout_keys: tuple[str, ...]


def _build(
    family: _Family,
    head: str | None,
    attention: str,
    dropout: float,
    seed: int | None,
    config: dict[str, Any],
) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if head not in family.heads:
        raise ValueError(f"head must be one of {list(family.heads)}, got {head!r}")
    settings = {
        **family.defaults,
        **dict.fromkeys(family.dropout_keys, dropout),
        "attn_implementation": attention,
        **config,
    }
    configuration = getattr(transformers, family.config)(**settings)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, family.heads[head])(configuration)


_GPT2 = _Family(
    "GPT2Config",
    {None: "GPT2Model", "causal_lm": "GPT2LMHeadModel"},
    {
        "n_layer": 2,
        "n_embd": 32,
        "n_head": 4,
        "vocab_size": 64,
        "n_positions": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
)


def tiny_gpt2(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``GPT2Model``, or ``GPT2LMHeadModel`` with ``head="causal_lm"``: 2 layers of width 32, 4 heads, a
    vocabulary of 64, 32 positions, bos and eos id 0.

    The language model's ``loss_type`` is named (its class name gives none), so a ``Trainer`` divides the
    summed loss by the shifted labels' count, as the model's own mean does, rather than by the unshifted
    labels' count; the model's own loss is the same either way."""
    model = _build(_GPT2, head, attention, dropout, seed, config)
    if head == "causal_lm":
        model.loss_type = "ForCausalLM"
    return model


_LLAMA = _Family(
    "LlamaConfig",
    {None: "LlamaModel", "causal_lm": "LlamaForCausalLM"},
    {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    },
    ("attention_dropout",),
)


def tiny_llama(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``LlamaModel``, or ``LlamaForCausalLM`` with ``head="causal_lm"``: 2 layers of width 32 (MLP 64), 4
    query heads sharing 2 key heads, a vocabulary of 64, 32 positions, bos, eos and pad id 0 (the pad id's
    embedding row starts at zero; ``pad_token_id=None`` keeps it random)."""
    return _build(_LLAMA, head, attention, dropout, seed, config)


_MISTRAL = _Family(
    "MistralConfig",
    {None: "MistralModel", "causal_lm": "MistralForCausalLM"},
    {**_LLAMA.defaults, "sliding_window": 3},
    ("attention_dropout",),
)


def tiny_mistral(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``MistralModel``, or ``MistralForCausalLM`` with ``head="causal_lm"``: LLaMA's shape (4 query heads
    sharing 2 key heads) with a sliding window of 3 keys (query i attends keys i − 2 … i)."""
    return _build(_MISTRAL, head, attention, dropout, seed, config)


_BERT = _Family(
    "BertConfig",
    {None: "BertModel", "masked_lm": "BertForMaskedLM"},
    {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 64,
        "max_position_embeddings": 32,
    },
    ("attention_probs_dropout_prob", "hidden_dropout_prob"),
)


def tiny_bert(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``BertModel``, or ``BertForMaskedLM`` with ``head="masked_lm"``: 2 layers of width 32 (MLP 64), 4
    heads, a vocabulary of 64, 32 positions."""
    return _build(_BERT, head, attention, dropout, seed, config)


_DISTILBERT = _Family(
    "DistilBertConfig",
    {None: "DistilBertModel"},
    {
        "n_layers": 2,
        "dim": 32,
        "hidden_dim": 64,
        "n_heads": 4,
        "vocab_size": 64,
        "max_position_embeddings": 32,
    },
    ("dropout", "attention_dropout"),
)


def tiny_distilbert(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``DistilBertModel``: 2 layers of width 32 (MLP 64), 4 heads, a vocabulary of 64, 32 positions."""
    return _build(_DISTILBERT, head, attention, dropout, seed, config)


_T5 = _Family(
    "T5Config",
    {None: "T5EncoderModel", "seq2seq_lm": "T5ForConditionalGeneration"},
    {
        "num_layers": 2,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_heads": 4,
        "vocab_size": 64,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    },
    ("dropout_rate",),
)


def tiny_t5(
    head: str | None = None,
    attention: str = "sdpa",
    dropout: float = 0.0,
    seed: int | None = 0,
    **config: Any,
) -> nn.Module:
    """``T5EncoderModel`` (T5 without a head is its encoder stack), or ``T5ForConditionalGeneration`` with
    ``head="seq2seq_lm"`` (as many decoder layers as encoder layers): 2 layers of width 32 (MLP 64), 4 heads
    of width 8, a vocabulary of 64, pad id 0, eos id 1, decoding from id 0."""
    return _build(_T5, head, attention, dropout, seed, config)
