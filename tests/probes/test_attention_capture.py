"""Attention capture: recomputed probabilities equal the kernels' own; the training run is not perturbed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_models import tiny_bert, tiny_gpt2
from torch import nn
from torch.utils.checkpoint import checkpoint

from spectral_monitor.probes import (
    ROOT_LAYER_NAME,
    AttentionCapture,
    AttentionInputs,
    register_attention_extractor,
)

ATOL = 1e-6
EMBED, HEADS, BATCH, QUERIES, KEYS = 16, 4, 3, 5, 6

# torch warns when key_padding_mask and attn_mask differ in type; mixing them is one of the cases we test.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched .*key_padding_mask")


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, with grouped-query heads and an optional additive bias instead of causality."""

    def __init__(
        self,
        embed: int,
        heads: int,
        kv_heads: int | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = embed // heads
        self.c_attn = nn.Linear(embed, (heads + 2 * self.kv_heads) * self.head_dim)
        self.c_proj = nn.Linear(embed, embed)
        self.dropout, self.scale, self.bias = dropout, scale, bias

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, tokens, _ = x.shape
        q, k, v = self.c_attn(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=2
        )
        q = q.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self.bias,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.bias is None,
            scale=self.scale,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, embed: int, heads: int, **attention):
        super().__init__()
        self.ln = nn.LayerNorm(embed)
        self.attn = CausalSelfAttention(embed, heads, **attention)
        self.mlp = nn.Sequential(
            nn.Linear(embed, 2 * embed), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * embed, embed)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2, embed: int = EMBED, heads: int = HEADS, **attention):
        super().__init__()
        self.blocks = nn.ModuleList(Block(embed, heads, **attention) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def hand_probs(
    q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """softmax(scale · Q Kᵀ + bias), float64, with SDPA's top-left causal pattern if asked."""
    logits = scale * q.double() @ k.double().transpose(-1, -2)
    if bias is not None:
        logits = logits + bias.double()
    if causal:
        logits = logits.masked_fill(~torch.ones(logits.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(logits, dim=-1).float()


def module_inputs(model: nn.Module, run) -> dict[str, tuple[tuple, dict]]:
    """The (args, kwargs) every module of ``model`` was called with during ``run()``."""
    calls, handles = {}, []
    for name, module in model.named_modules():

        def remember(module, args, kwargs, name=name):
            calls.setdefault(name, (args, kwargs))

        handles.append(module.register_forward_pre_hook(remember, with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def need_weights_reference(attention: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    kwargs = {**kwargs, "need_weights": True, "average_attn_weights": False}
    with torch.no_grad():
        return attention(*args, **kwargs)[1]


def hook_count(model: nn.Module) -> int:
    return sum(
        len(module._forward_pre_hooks)
        + len(module._forward_hooks)
        + len(module._forward_hooks_with_kwargs)
        + len(module._forward_hooks_always_called)
        for module in model.modules()
    )


def attendable_rows_bool_mask(
    rows: int, cols: int, *leading: int, generator: torch.Generator
) -> torch.Tensor:
    """A random bool mask (True = masked, as MultiheadAttention has it) leaving key 0 open to every query."""
    mask = torch.rand(*leading, rows, cols, generator=generator) < 0.4
    mask[..., 0] = False
    return mask


def multihead_attention_cases():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, QUERIES, EMBED, generator=g)
    memory = torch.randn(BATCH, KEYS, EMBED, generator=g)
    padding = torch.zeros(BATCH, QUERIES, dtype=torch.bool)
    padding[1, 3:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(QUERIES)
    float_3d = torch.randn(BATCH * HEADS, QUERIES, QUERIES, generator=g)
    float_3d[:, :, 1:].masked_fill_(
        torch.rand(BATCH * HEADS, QUERIES, QUERIES - 1, generator=g) < 0.3, -math.inf
    )
    cross_key = torch.randn(BATCH, KEYS, 12, generator=g)
    cross_value = torch.randn(BATCH, KEYS, 10, generator=g)
    other_value = torch.randn(
        BATCH, QUERIES, EMBED, generator=g
    )  # DETR's call: query = key = x + pos, value x
    return {
        "packed self-attention": ({}, (x, x, x), {}),
        "separate kdim/vdim cross-attention": ({"kdim": 12, "vdim": 10}, (x, cross_key, cross_value), {}),
        "cross-attention on memory": ({}, (x, memory, memory), {}),
        "bias_k/bias_v with key padding": ({"add_bias_kv": True}, (x, x, x), {"key_padding_mask": padding}),
        "add_zero_attn with float 2-D mask": ({"add_zero_attn": True}, (x, x, x), {"attn_mask": causal}),
        "bool 2-D attn_mask": (
            {},
            (x, memory, memory),
            {"attn_mask": attendable_rows_bool_mask(QUERIES, KEYS, generator=g)},
        ),
        "bool 3-D attn_mask": (
            {},
            (x, x, x),
            {"attn_mask": attendable_rows_bool_mask(QUERIES, QUERIES, BATCH * HEADS, generator=g)},
        ),
        "float 3-D attn_mask": ({}, (x, x, x), {"attn_mask": float_3d}),
        "bool key_padding_mask": ({}, (x, x, x), {"key_padding_mask": padding}),
        "q = k with another value, key padding": ({}, (x, x, other_value), {"key_padding_mask": padding}),
        "float key_padding_mask": (
            {},
            (x, x, x),
            {"key_padding_mask": torch.zeros(padding.shape).masked_fill(padding, -math.inf)},
        ),
        "is_causal": ({}, (x, x, x), {"attn_mask": causal, "is_causal": True}),
        "is_causal with key padding": (
            {},
            (x, x, x),
            {"attn_mask": causal, "is_causal": True, "key_padding_mask": padding},
        ),
        "is_causal with bias_k/add_zero_attn under need_weights": (
            {"add_bias_kv": True, "add_zero_attn": True},
            (x, x, x),
            {"attn_mask": causal, "is_causal": True, "need_weights": True},
        ),
    }


MHA_CASES = multihead_attention_cases()


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_probs_equal_need_weights_weights(case, batch_first):
    constructor, inputs, call = MHA_CASES[case]
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, **constructor).eval()
    if not batch_first:  # transpose each distinct tensor once: self-attention passes the same tensor thrice
        transposed = {}
        inputs = tuple(transposed.setdefault(id(tensor), tensor.transpose(0, 1)) for tensor in inputs)
    capture = AttentionCapture(attention, max_sequences=BATCH)
    with capture.armed() as recording:
        attention(*inputs, **{"need_weights": False, **call})
    assert [c.layer for c in recording.captured] == [ROOT_LAYER_NAME] and not recording.skipped
    sample = recording.samples()[0]
    reference = need_weights_reference(attention, inputs, call)
    torch.testing.assert_close(sample.probs, reference, atol=ATOL, rtol=0)
    assert sample.probs.dtype == torch.float32
    extra_key_columns = constructor.get("add_bias_kv") or constructor.get("add_zero_attn")
    assert sample.causal == (call.get("is_causal", False) and not extra_key_columns)
    padding = call.get("key_padding_mask")
    if padding is not None:
        padded = padding if padding.dtype == torch.bool else torch.isneginf(padding)
        extra = sample.probs.shape[-1] - padded.shape[-1]
        torch.testing.assert_close(sample.key_mask, F.pad(~padded, (0, extra), value=True))
        torch.testing.assert_close(
            sample.query_mask, ~padded
        )  # self-attention: padded keys are padded queries


def test_unbatched_multihead_attention_is_one_sequence():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS).eval()
    x = torch.randn(QUERIES, EMBED)
    with AttentionCapture(attention).armed() as recording:
        attention(x, x, x, need_weights=False)
    probs = recording.samples()[0].probs
    reference = need_weights_reference(attention, (x, x, x), {})
    torch.testing.assert_close(probs, reference.unsqueeze(0), atol=ATOL, rtol=0)


def test_causal_bias_k_capture_follows_the_training_kernel_not_need_weights():
    """With is_causal and no padding, torch's training path runs causal SDPA over the extra bias_k column
    (hiding it from early queries) while need_weights applies attn_mask: the capture follows training."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True, batch_first=True).eval()
    x = torch.randn(BATCH, QUERIES, EMBED)
    causal = nn.Transformer.generate_square_subsequent_mask(QUERIES)
    with AttentionCapture(attention, max_sequences=BATCH).armed() as recording:
        output = attention(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    captured = recording.captured[0]
    value = F.linear(x, *[p.chunk(3)[2] for p in (attention.in_proj_weight, attention.in_proj_bias)])
    value = torch.cat([value, attention.bias_v.expand(BATCH, 1, EMBED)], dim=1)
    value = value.view(BATCH, QUERIES + 1, HEADS, EMBED // HEADS).transpose(1, 2)
    mixed = (captured.probs() @ value).transpose(1, 2).reshape(BATCH, QUERIES, EMBED)
    torch.testing.assert_close(attention.out_proj(mixed), output, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_encoder_layers_probs_equal_need_weights_weights(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, 32, dropout=0.1, batch_first=batch_first)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    src = torch.randn(BATCH, QUERIES, EMBED)
    if not batch_first:
        src = src.transpose(0, 1)
    padding = torch.zeros(BATCH, QUERIES, dtype=torch.bool)
    padding[2, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(QUERIES)

    def run():
        return encoder(src, mask=causal, src_key_padding_mask=padding, is_causal=True)

    calls = module_inputs(encoder, run)
    with AttentionCapture(encoder, max_sequences=BATCH).armed() as recording:
        run()
    assert [c.layer for c in recording.captured] == ["layers.0.self_attn", "layers.1.self_attn"]
    for sample in recording.samples():
        attention = encoder.get_submodule(sample.layer)
        reference = need_weights_reference(attention, *calls[sample.layer])
        torch.testing.assert_close(sample.probs, reference, atol=ATOL, rtol=0)
        assert sample.causal
        torch.testing.assert_close(sample.query_mask, ~padding)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_decoder_layer_self_and_cross_attention_equal_need_weights_weights(batch_first):
    torch.manual_seed(0)
    decoder = nn.TransformerDecoderLayer(EMBED, HEADS, 32, dropout=0.1, batch_first=batch_first).eval()
    tgt, memory = torch.randn(BATCH, QUERIES, EMBED), torch.randn(BATCH, KEYS, EMBED)
    if not batch_first:
        tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
    memory_padding = torch.zeros(BATCH, KEYS, dtype=torch.bool)
    memory_padding[0, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(QUERIES)

    def run():
        return decoder(
            tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_padding
        )

    calls = module_inputs(decoder, run)
    with AttentionCapture(decoder, max_sequences=BATCH).armed() as recording:
        run()
    assert [c.layer for c in recording.captured] == ["self_attn", "multihead_attn"]
    self_attention, cross_attention = recording.samples()
    for sample in (self_attention, cross_attention):
        reference = need_weights_reference(decoder.get_submodule(sample.layer), *calls[sample.layer])
        torch.testing.assert_close(sample.probs, reference, atol=ATOL, rtol=0)
    assert self_attention.causal and not cross_attention.causal
    assert cross_attention.probs.shape == (BATCH, HEADS, QUERIES, KEYS)
    torch.testing.assert_close(cross_attention.key_mask, ~memory_padding)
    assert cross_attention.query_mask is None  # cross-attention: key padding says nothing about the queries


@pytest.mark.parametrize(
    "attention",
    [
        {},
        {"kv_heads": 2},
        {"scale": 0.3, "bias": torch.randn(QUERIES, QUERIES).masked_fill(torch.eye(QUERIES) == 0, -1e4)},
        {"bias": torch.rand(BATCH, 1, QUERIES, QUERIES) < 0.6},
    ],
    ids=["causal", "grouped-query causal", "additive float mask and scale", "bool mask per sequence"],
)
def test_sdpa_probs_equal_softmax_of_scaled_logits(attention):
    torch.manual_seed(0)
    bias = attention.get("bias")
    if bias is not None and bias.dtype == torch.bool:
        bias = bias | torch.eye(QUERIES, dtype=torch.bool)  # every query keeps a key
        attention = {**attention, "bias": bias}
    model = TinyGPT(**attention).eval()
    x = torch.randn(BATCH, QUERIES, EMBED)
    calls = module_inputs(model, lambda: model(x))
    with AttentionCapture(model, max_sequences=BATCH).armed() as recording:
        model(x)
    assert [c.layer for c in recording.captured] == ["blocks.0.attn", "blocks.1.attn"]
    for sample in recording.samples():
        module = model.get_submodule(sample.layer)
        with torch.no_grad():
            q, k, _ = module.project(*calls[sample.layer][0])
        k = k.repeat_interleave(module.heads // module.kv_heads, dim=1)
        scale = attention.get("scale", 1 / math.sqrt(module.head_dim))
        additive = None
        if bias is not None:
            additive = (
                bias if bias.is_floating_point() else torch.zeros(bias.shape).masked_fill(~bias, -math.inf)
            )
        reference = hand_probs(q, k, scale, additive, causal=bias is None)
        torch.testing.assert_close(sample.probs, reference, atol=ATOL, rtol=0)
        assert sample.causal == (bias is None) and sample.scale == pytest.approx(scale)
    captured = recording.captured[0]
    assert captured.k.shape == captured.q.shape  # grouped keys repeated per query head


def test_bfloat16_inputs_are_kept_as_is_and_probs_upcast():
    torch.manual_seed(0)
    model = TinyGPT(layers=1).to(torch.bfloat16).eval()
    x = torch.randn(BATCH, QUERIES, EMBED, dtype=torch.bfloat16)
    calls = module_inputs(model, lambda: model(x))
    with AttentionCapture(model).armed() as recording:
        model(x)
    captured = recording.captured[0]
    assert captured.q.dtype == torch.bfloat16 and captured.probs().dtype == torch.float32
    with torch.no_grad():
        q, k, _ = model.blocks[0].attn.project(*calls["blocks.0.attn"][0])
    torch.testing.assert_close(captured.probs(), hand_probs(q, k, 0.5, causal=True), atol=ATOL, rtol=0)


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "padding"])
def test_hugging_face_gpt2_sdpa_probs_equal_hand_computation(padded):
    model = tiny_gpt2(n_embd=EMBED, n_head=2, vocab_size=50).eval()
    ids = torch.randint(0, 50, (BATCH, 7), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(BATCH, 7, dtype=torch.long)
    if padded:
        attention_mask[1, 5:] = 0
    calls = module_inputs(model, lambda: model(ids, attention_mask=attention_mask))
    with AttentionCapture(model, max_sequences=BATCH).armed() as recording:
        model(ids, attention_mask=attention_mask)
    assert [c.layer for c in recording.captured] == ["h.0.attn", "h.1.attn"]
    for index, sample in enumerate(recording.samples()):
        block = model.h[index]
        hidden = calls[f"h.{index}"][0][0]
        with torch.no_grad():
            q, k, _ = block.attn.c_attn(block.ln_1(hidden)).split(EMBED, dim=2)
        q, k = (t.view(BATCH, 7, 2, EMBED // 2).transpose(1, 2) for t in (q, k))
        key_padding = torch.zeros(BATCH, 1, 1, 7).masked_fill(
            attention_mask[:, None, None, :] == 0, -math.inf
        )
        reference = hand_probs(q, k, 1 / math.sqrt(EMBED // 2), key_padding, causal=True)
        torch.testing.assert_close(sample.probs, reference, atol=ATOL, rtol=0)
        if padded:
            torch.testing.assert_close(sample.key_mask, attention_mask.bool())


def test_hugging_face_bert_sdpa_probs_equal_hand_computation_with_padding():
    model = tiny_bert(hidden_size=EMBED, num_attention_heads=2, intermediate_size=32, vocab_size=50).eval()
    ids = torch.randint(0, 50, (BATCH, 7), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones(BATCH, 7, dtype=torch.long)
    attention_mask[0, 4:] = 0
    calls = module_inputs(model, lambda: model(ids, attention_mask=attention_mask))
    capture = AttentionCapture(model, max_sequences=2)
    with capture.armed(token_mask=attention_mask.bool()) as recording:
        model(ids, attention_mask=attention_mask)
    assert [c.layer for c in recording.captured] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    for sample in recording.samples():
        attention = model.get_submodule(sample.layer)
        hidden = calls[sample.layer][0][0][:2]
        with torch.no_grad():
            q, k = (
                projection(hidden).view(2, 7, 2, EMBED // 2).transpose(1, 2)
                for projection in (attention.query, attention.key)
            )
        key_padding = torch.zeros(2, 1, 1, 7).masked_fill(attention_mask[:2, None, None, :] == 0, -math.inf)
        torch.testing.assert_close(
            sample.probs, hand_probs(q, k, 1 / math.sqrt(EMBED // 2), key_padding), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(sample.key_mask, attention_mask[:2].bool())
        torch.testing.assert_close(sample.query_mask, attention_mask[:2].bool())


class EncoderThenGPT(nn.Module):
    """Both kernels in one model, everything with dropout: MultiheadAttention layers, then SDPA blocks."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, 32, dropout=0.2, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.gpt = TinyGPT(dropout=0.2)

    def forward(self, x):
        return self.gpt(self.encoder(x, src_key_padding_mask=x[..., 0] > 1.5))


def torch_training_setup():
    torch.manual_seed(0)
    return EncoderThenGPT().train(), torch.randn(4, 7, EMBED), lambda output: output, 4


def gpt2_training_setup():
    return (
        tiny_gpt2(dropout=0.2, n_embd=EMBED, n_head=2, vocab_size=50).train(),
        torch.randint(0, 50, (4, 7)),
        lambda output: output.last_hidden_state,
        2,
    )


def train_step(model: nn.Module, x: torch.Tensor, hidden, capture: AttentionCapture | None):
    """Forward and backward (inside the armed block when capturing): what a training run depends on."""
    torch.manual_seed(123)
    model.zero_grad(set_to_none=True)
    recording = None
    if capture is None:
        output = hidden(model(x))
        output.square().mean().backward()
    else:
        with capture.armed() as recording:
            output = hidden(model(x))
            output.square().mean().backward()
    return output.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state(), recording


@pytest.mark.parametrize("setup", [torch_training_setup, gpt2_training_setup], ids=["torch", "gpt2"])
def test_armed_training_step_is_bit_identical_and_leaves_no_hooks(setup):
    model, x, hidden, attention_layers = setup()
    hooks_before = hook_count(model)
    plain_output, plain_grads, plain_rng, _ = train_step(model, x, hidden, None)
    armed_output, armed_grads, armed_rng, recording = train_step(
        model, x, hidden, AttentionCapture(model, max_sequences=2)
    )
    assert torch.equal(plain_output, armed_output)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, armed_grads, strict=True))
    assert torch.equal(plain_rng, armed_rng)  # no random numbers drawn
    assert len(recording.captured) == attention_layers and not recording.skipped
    assert hook_count(model) == hooks_before
    assert torch._C._len_torch_function_stack() == 0


def test_only_the_first_sequences_are_kept_as_copies():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    x = torch.randn(5, QUERIES, EMBED)
    with AttentionCapture(model, max_sequences=5).armed() as full:
        model(x)
    with AttentionCapture(model, max_sequences=2).armed() as sampled:
        model(x)
    for whole, kept in zip(full.captured, sampled.captured, strict=True):
        assert kept.q.shape[0] == kept.k.shape[0] == 2
        torch.testing.assert_close(kept.probs(), whole.probs()[:2], atol=0, rtol=0)
        for tensor in (kept.q, kept.k):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            assert not tensor.requires_grad


def test_nothing_is_captured_when_not_armed():
    torch.manual_seed(0)
    model = EncoderThenGPT()
    x = torch.randn(2, QUERIES, EMBED)
    capture = AttentionCapture(model)
    assert hook_count(model) == 0 and not capture.is_armed
    with capture.armed() as recording:
        model(x)
    captured = len(recording.captured)
    model(x)
    assert len(recording.captured) == captured == 4
    assert hook_count(model) == 0 and not capture.is_armed
    assert torch._C._len_torch_function_stack() == 0


def test_memory_budget_cuts_sequences_then_heads_then_layers_and_says_so():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    x = torch.randn(4, 8, EMBED)
    with AttentionCapture(model).armed() as full:
        model(x)
    layers = full.captured

    def budgeted(max_bytes):
        with AttentionCapture(model, max_bytes=max_bytes).armed() as recording:
            model(x)
        assert recording.nbytes() <= max_bytes
        return recording

    two_sequences = budgeted(sum(layer.nbytes(2, HEADS) for layer in layers))
    assert [c.q.shape[:2] for c in two_sequences.captured] == [(2, HEADS)] * 2
    assert len(two_sequences.skipped) == 2
    assert all(
        s.reason.endswith(f"kept 2 of 4 sequences and {HEADS} of {HEADS} heads")
        for s in two_sequences.skipped
    )
    torch.testing.assert_close(two_sequences.captured[1].probs(), layers[1].probs()[:2], atol=0, rtol=0)

    three_heads = budgeted(sum(layer.nbytes(1, 3) for layer in layers))
    assert [c.q.shape[:2] for c in three_heads.captured] == [(1, 3)] * 2
    assert all("kept 1 of 4 sequences and 3 of 4 heads" in s.reason for s in three_heads.skipped)

    one_layer = budgeted(layers[0].nbytes(1, 1))
    assert [c.layer for c in one_layer.captured] == ["blocks.0.attn"]
    assert one_layer.skipped[-1].layer == "blocks.1.attn" and "not kept" in one_layer.skipped[-1].reason

    with AttentionCapture(model, max_bytes=full.nbytes()).armed() as unbounded:
        model(x)
    assert not unbounded.skipped and len(unbounded.captured) == 2


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = CausalSelfAttention(EMBED, HEADS)

    def forward(self, x):
        return self.attn(self.attn(x))


def test_a_module_called_twice_is_captured_once_with_its_first_call():
    torch.manual_seed(0)
    model = Reused().eval()
    x = torch.randn(2, QUERIES, EMBED)
    calls = module_inputs(model, lambda: model(x))
    with AttentionCapture(model).armed() as recording:
        model(x)
    assert [c.layer for c in recording.captured] == ["attn"]
    with torch.no_grad():
        q, k, _ = model.attn.project(*calls["attn"][0])
    torch.testing.assert_close(
        recording.captured[0].probs(), hand_probs(q, k, 0.5, causal=True), atol=ATOL, rtol=0
    )


class Checkpointed(TinyGPT):
    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpoint_recomputation_during_backward_is_not_duplicated():
    torch.manual_seed(0)
    model = Checkpointed().train()
    x = torch.randn(2, QUERIES, EMBED)
    with AttentionCapture(model).armed() as recording:
        model(x).sum().backward()
    assert [c.layer for c in recording.captured] == ["blocks.0.attn", "blocks.1.attn"]


class HandWrittenAttention(nn.Module):
    """Attention computed by hand (no kernel call): needs a registered extractor."""

    def __init__(self):
        super().__init__()
        self.query, self.key = nn.Linear(EMBED, EMBED), nn.Linear(EMBED, EMBED)

    def heads(self, x):
        return x.view(*x.shape[:2], HEADS, -1).transpose(1, 2)

    def forward(self, x, padding=None):
        logits = self.heads(self.query(x)) @ self.heads(self.key(x)).transpose(-1, -2) / 2
        if padding is not None:
            logits = logits.masked_fill(padding[:, None, None, :], -math.inf)
        probs = logits.softmax(-1)
        return probs @ self.heads(x), probs


def hand_written_extractor(module, args, kwargs, output):
    x = args[0]
    padding = kwargs.get("padding")
    mask = None if padding is None else ~padding[:, None, None, :]
    return AttentionInputs(
        q=module.heads(module.query(x)), k=module.heads(module.key(x)), mask=mask, scale=0.5
    )


class WithHandWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = HandWrittenAttention()
        self.attn = CausalSelfAttention(EMBED, HEADS)

    def forward(self, x, padding):
        return self.attn(x), self.mixer(x, padding=padding)[1]


def test_registered_extractor_captures_hand_written_attention():
    torch.manual_seed(0)
    model = WithHandWritten().eval()
    x = torch.randn(3, QUERIES, EMBED)
    padding = torch.zeros(3, QUERIES, dtype=torch.bool)
    padding[0, 3:] = True
    capture = AttentionCapture(model, extractors={HandWrittenAttention: hand_written_extractor})
    with capture.armed() as recording:
        _, probs = model(x, padding)
    assert [c.layer for c in recording.captured] == ["attn", "mixer"]
    mixer = recording.samples()[1]
    torch.testing.assert_close(mixer.probs, probs.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(mixer.key_mask, ~padding)


def test_globally_registered_extractor_by_name_until_removed():
    torch.manual_seed(0)
    model = WithHandWritten().eval()
    x = torch.randn(2, QUERIES, EMBED)
    padding = torch.zeros(2, QUERIES, dtype=torch.bool)
    with (
        register_attention_extractor("mix*", hand_written_extractor),
        AttentionCapture(model).armed() as registered,
    ):
        model(x, padding)
    with AttentionCapture(model).armed() as removed:
        model(x, padding)
    assert [c.layer for c in registered.captured] == ["attn", "mixer"]
    assert [c.layer for c in removed.captured] == ["attn"]


def test_failing_extractor_is_reported_and_forward_goes_on_unless_strict():
    torch.manual_seed(0)
    model = WithHandWritten().eval()
    x = torch.randn(2, QUERIES, EMBED)
    padding = torch.zeros(2, QUERIES, dtype=torch.bool)

    def broken(module, args, kwargs, output):
        raise KeyError("no q here")

    with AttentionCapture(model, extractors={"mixer": broken}).armed() as recording:
        model(x, padding)
    assert [c.layer for c in recording.captured] == ["attn"]
    assert recording.skipped[0].layer == "mixer" and "no q here" in recording.skipped[0].reason
    with (
        pytest.raises(KeyError, match="no q here"),
        AttentionCapture(model, extractors={"mixer": broken}, strict=True).armed(),
    ):
        model(x, padding)
    assert hook_count(model) == 0 and torch._C._len_torch_function_stack() == 0


def test_eval_forward_under_no_grad_keeps_fused_fast_path_and_says_why_nothing_was_captured():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 9, EMBED)
    with torch.no_grad():
        plain = encoder(x)
        with AttentionCapture(encoder).armed() as recording:
            armed = encoder(x)
    assert torch.equal(plain, armed)
    assert not recording.captured
    assert recording.skipped[0].layer == "*" and "fast path" in recording.skipped[0].reason


def test_bad_arguments_are_rejected_with_their_names():
    model = TinyGPT(layers=1)
    with pytest.raises(ValueError, match="max_sequences"):
        AttentionCapture(model, max_sequences=0)
    with pytest.raises(ValueError, match="max_bytes"):
        AttentionCapture(model, max_bytes=-5)
    with pytest.raises(ValueError, match="extractors"):
        AttentionCapture(model, extractors={3: hand_written_extractor})
    with pytest.raises(ValueError, match="model"):
        AttentionCapture("not a model")
    capture = AttentionCapture(model)
    with pytest.raises(ValueError, match="token_mask"):
        capture.arm(token_mask=torch.ones(3, dtype=torch.bool))
    capture.arm()
    with pytest.raises(RuntimeError, match="already armed"):
        capture.arm()
    capture.disarm()
    with pytest.raises(RuntimeError, match="not armed"):
        capture.disarm()
