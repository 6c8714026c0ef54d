"""Residual-stream capture: the right blocks, their exact outputs as (S, n, d) float32 copies, no more."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import tiny_bert, tiny_gpt2
from torch import nn

from spectral_monitor.probes import ResidualCapture, find_transformer_blocks

EMBED, HEADS, BATCH, TOKENS = 16, 4, 3, 6


def block_outputs(model: nn.Module, names, run) -> dict[str, torch.Tensor]:
    """What each named module returned during ``run()`` (first tensor of a tuple), for reference."""
    outputs, handles = {}, []
    for name in names:

        def remember(module, args, output, name=name):
            outputs.setdefault(name, output if isinstance(output, torch.Tensor) else output[0])

        handles.append(model.get_submodule(name).register_forward_hook(remember))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_encoder_block_outputs_are_captured_batch_first_with_their_padding(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, 32, batch_first=batch_first)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False).train()
    src = torch.randn(BATCH, TOKENS, EMBED)
    if not batch_first:
        src = src.transpose(0, 1)
    padding = torch.zeros(BATCH, TOKENS, dtype=torch.bool)
    padding[1, 4:] = True
    capture = ResidualCapture(model, max_sequences=2)
    assert capture.blocks == ("layers.0", "layers.1", "layers.2")

    torch.manual_seed(1)
    reference = block_outputs(model, capture.blocks, lambda: model(src, src_key_padding_mask=padding))
    torch.manual_seed(1)  # same dropout masks: the captured outputs are those of the same forward
    with capture.armed() as recording:
        model(src, src_key_padding_mask=padding)

    assert [sample.layer for sample in recording.states] == list(capture.blocks)
    for sample in recording.states:
        expected = reference[sample.layer] if batch_first else reference[sample.layer].transpose(0, 1)
        assert sample.states.shape == (2, TOKENS, EMBED) and sample.states.dtype == torch.float32
        assert torch.equal(sample.states, expected[:2].detach())
        assert torch.equal(sample.token_mask, ~padding[:2])
        assert not sample.states.requires_grad
        assert sample.states.untyped_storage().nbytes() == sample.states.numel() * 4  # a copy, not a view


def test_decoder_block_output_and_target_padding():
    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.TransformerDecoderLayer(EMBED, HEADS, 32)])}).eval()
    tgt, memory = torch.randn(TOKENS, BATCH, EMBED), torch.randn(TOKENS + 2, BATCH, EMBED)
    padding = torch.zeros(BATCH, TOKENS, dtype=torch.bool)
    padding[0, 5:] = True
    with ResidualCapture(model).armed() as recording:
        output = model["layers"][0](tgt, memory, tgt_key_padding_mask=padding)
    (sample,) = recording.states
    assert sample.layer == "layers.0"
    assert torch.equal(sample.states, output.transpose(0, 1).detach())
    assert torch.equal(sample.token_mask, ~padding)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(EMBED, EMBED)

    def forward(self, x):
        return x + self.mix(x), "an extra tuple element"


class NanoModel(nn.Module):
    """Blocks found by the ModuleList rule; a ``layers`` list of plain Linears is not taken for blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.layers = nn.ModuleList(nn.Linear(EMBED, EMBED) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x, _ = block(x)
        for linear in self.layers:
            x = linear(x)
        return x


def test_block_like_children_of_named_module_lists_are_found_and_tuple_outputs_read():
    torch.manual_seed(0)
    model = NanoModel()
    x = torch.randn(BATCH, TOKENS, EMBED)
    capture = ResidualCapture(model, max_sequences=BATCH)
    assert capture.blocks == ("blocks.0", "blocks.1")
    reference = block_outputs(model, capture.blocks, lambda: model(x))
    token_mask = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    token_mask[2, 3:] = False
    with capture.armed(token_mask=token_mask) as recording:
        model(x)
    for sample in recording.states:
        assert torch.equal(sample.states, reference[sample.layer].detach())
        assert torch.equal(sample.token_mask, token_mask)


def test_name_patterns_choose_the_blocks_and_a_pattern_matching_nothing_is_an_error():
    model = NanoModel()
    assert find_transformer_blocks(model, ["layers.*"]) == ["layers.0", "layers.1"]
    stack = nn.Module()
    stack.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2)])
    assert find_transformer_blocks(stack, ["blocks.*"]) == ["blocks.0", "blocks.1"]  # not their parts
    with pytest.raises(ValueError, match="block_patterns"):
        ResidualCapture(model, block_patterns=["decoder.*"])
    with pytest.raises(ValueError, match="block_patterns"):
        ResidualCapture(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="max_sequences"):
        ResidualCapture(model, max_sequences=0)
    with pytest.raises(ValueError, match="block_patterns"):
        ResidualCapture(model, block_patterns="layers.*")


def test_hugging_face_blocks_are_found_and_equal_the_hidden_states():
    gpt2 = tiny_gpt2(dropout=0.1, seed=None, n_embd=EMBED, n_head=2, vocab_size=50).eval()
    bert = tiny_bert(
        seed=None, hidden_size=EMBED, num_attention_heads=2, intermediate_size=32, vocab_size=50
    ).eval()
    ids = torch.randint(0, 50, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    assert find_transformer_blocks(bert) == ["encoder.layer.0", "encoder.layer.1"]
    capture = ResidualCapture(gpt2, max_sequences=2)
    assert capture.blocks == ("h.0", "h.1")
    with capture.armed() as recording:
        hidden_states = gpt2(ids, output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is the output of block i, except the last, which is after the final layer norm
    assert torch.equal(recording.states[0].states, hidden_states[1][:2])
    assert recording.states[1].states.shape == (2, TOKENS, EMBED)
    with torch.no_grad():
        assert torch.equal(recording.states[1].states, gpt2.h[1](hidden_states[1])[:2])


def test_nothing_is_captured_when_not_armed_and_hooks_are_removed():
    torch.manual_seed(0)
    model = NanoModel()
    x = torch.randn(BATCH, TOKENS, EMBED)
    capture = ResidualCapture(model)
    assert hook_count(model) == 0
    with capture.armed() as recording:
        model(x)
        # An output hook per block, and the pre- and post-hook of every module that read padding masks.
        assert hook_count(model) == 2 + 2 * len(list(model.modules()))
    model(x)
    assert len(recording.states) == 2 and hook_count(model) == 0 and not capture.is_armed
    with pytest.raises(RuntimeError, match="not armed"):
        capture.disarm()
