"""The registry of attention-family knowledge: how modules are recognised, counted and read, and how a
registration changes what every reader sees."""

from __future__ import annotations

import torch
from torch import nn

from spectral_monitor.probes import QKVLayout, register_qkv_layout
from spectral_monitor.probes.attention_families import (
    declared_head_count,
    declared_model_width,
    fused_projection_name,
    looks_like_attention,
    read_attention_weights,
)
from spectral_monitor.probes.wrappers import data_parallel_unwrapped


class HandWrittenAttention(nn.Module):
    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.n_heads = heads
        self.Wqkv = nn.Linear(width, 3 * width)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = HandWrittenAttention()


def test_class_names_with_attention_in_them_look_like_attention_written_by_hand():
    assert looks_like_attention(HandWrittenAttention())
    assert not looks_like_attention(nn.MultiheadAttention(8, 2))  # its kernel call is always seen
    assert not looks_like_attention(nn.Linear(2, 2))


def test_the_first_positive_int_attribute_is_the_declared_count():
    module = nn.Module()
    module.n_head = None
    module.num_heads = 4
    module.embed_dim = 0
    module.hidden_size = 32
    assert declared_head_count(module) == 4
    assert declared_model_width(module) == 32
    assert declared_head_count(nn.Linear(2, 2)) is None


def test_a_fused_projection_is_read_only_once_its_layout_is_registered():
    module = HandWrittenAttention()
    assert read_attention_weights("attention", module) is None
    assert fused_projection_name(module) == "Wqkv"
    with register_qkv_layout("*.attention", QKVLayout("Wqkv", "concatenated")):
        assert read_attention_weights("other", module) is None  # the pattern is over qualified names
        weights = read_attention_weights("blocks.0.attention", module)
        assert weights is not None and weights.num_heads == 2 and weights.replaces == ("Wqkv",)
        assert torch.equal(weights.key, module.Wqkv.weight.detach()[8:16])
    assert read_attention_weights("blocks.0.attention", module) is None  # the handle unregistered it


def test_only_data_parallel_wrappers_are_seen_through_by_the_plain_loop():
    model = Block()
    assert data_parallel_unwrapped(model) is model
    compiled = torch.compile(model)
    assert data_parallel_unwrapped(compiled) is compiled  # how a compiled model is called decides its probe
