"""The weight probe reads the query, key and value projections of Hugging Face attention as each family names
them, per head: BERT and RoBERTa (``query``/``key``/``value``), T5 (``q``/``k``/``v``/``o``), DistilBERT
(``q_lin``/``k_lin``/``v_lin``), Llama with grouped keys and ViT (``q_proj``/``k_proj``/``v_proj``/``o_proj``)
and GPT-2 (packed ``c_attn``). Each head's ‖W_Q^hᵀ W_K^g‖₂ and each head's σ₁ are checked against float64
SVDs of the module's own weights, split as the model's forward splits its heads
(contiguous rows of width d_k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers.hf_models import tiny_bert, tiny_distilbert, tiny_gpt2, tiny_llama, tiny_t5
from helpers.reference_metrics import attention_probabilities
from torch import nn

from spectral_monitor.probes.weights import WeightProbe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40


@dataclass(frozen=True)
class Layout:
    """Where a family keeps one attention module's projections, and how many heads it has."""

    build: Any
    attention: str  # the attention module's qualified name
    projections: tuple[str, str, str]  # query, key, value submodule names (GPT-2: one packed name)
    heads: int
    key_heads: int
    output: str  # the output projection, measured whole


def bert(attention: str = "sdpa", seed: int | None = None) -> nn.Module:
    return tiny_bert(
        attention=attention,
        seed=seed,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=24,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )


def roberta() -> nn.Module:
    config = transformers.RobertaConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=24,
        vocab_size=VOCAB,
        max_position_embeddings=20,
        pad_token_id=1,
    )
    return transformers.RobertaModel(config)


def t5() -> nn.Module:
    return tiny_t5(seed=None, num_layers=1, d_model=16, d_kv=6, d_ff=24, num_heads=3, vocab_size=VOCAB)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=24,
        image_size=8,
        patch_size=4,
    )
    return transformers.ViTModel(config)


def distilbert() -> nn.Module:
    return tiny_distilbert(
        seed=None, n_layers=1, dim=16, hidden_dim=24, vocab_size=VOCAB, max_position_embeddings=512
    )


def llama() -> nn.Module:
    return tiny_llama(
        seed=None,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=24,
        vocab_size=VOCAB,
        pad_token_id=None,
    )


def gpt2() -> nn.Module:
    return tiny_gpt2(seed=None, n_layer=1, n_embd=16, n_positions=16, vocab_size=VOCAB)


LAYOUTS = {
    "bert": Layout(bert, "encoder.layer.0.attention.self", ("query", "key", "value"), 4, 4, "output.dense"),
    "roberta": Layout(
        roberta, "encoder.layer.0.attention.self", ("query", "key", "value"), 4, 4, "output.dense"
    ),
    "t5": Layout(t5, "encoder.block.0.layer.0.SelfAttention", ("q", "k", "v"), 3, 3, "o"),
    "vit": Layout(vit, "layers.0.attention", ("q_proj", "k_proj", "v_proj"), 4, 4, "o_proj"),
    "distilbert": Layout(
        distilbert, "transformer.layer.0.attention", ("q_lin", "k_lin", "v_lin"), 4, 4, "out_lin"
    ),
    "llama": Layout(llama, "layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), 4, 2, "o_proj"),
    "gpt2": Layout(gpt2, "h.0.attn", ("c_attn", "c_attn", "c_attn"), 4, 4, "c_proj"),
}


def projection_weights(model: nn.Module, layout: Layout) -> list[torch.Tensor]:
    """W_Q, W_K, W_V as (out, in) float64, read from the model's own modules."""
    attention = model.get_submodule(layout.attention)
    if layout.projections[0] == "c_attn":  # a Conv1D stores (in, out) with columns [W_Q | W_K | W_V]
        return list(attention.c_attn.weight.detach().double().T.chunk(3))
    return [attention.get_submodule(name).weight.detach().double() for name in layout.projections]


def largest_singular_value(matrix: torch.Tensor) -> float:
    return float(np.linalg.svd(matrix.numpy(), compute_uv=False)[0])


@pytest.mark.parametrize("family", LAYOUTS)
def test_each_head_of_hugging_face_attention_is_measured_against_float64(family: str) -> None:
    layout = LAYOUTS[family]
    torch.manual_seed(0)
    model = layout.build().eval()
    records = {record.tag: record.value for record in WeightProbe(model, per_head=True).measure(0)}
    query, key, value = projection_weights(model, layout)
    width = query.shape[0] // layout.heads
    group = layout.heads // layout.key_heads

    def head(weight: torch.Tensor, index: int) -> torch.Tensor:
        return weight[index * width : (index + 1) * width]

    name = layout.attention
    expected_norms = []
    for index in range(layout.heads):
        bilinear = head(query, index).T @ head(key, index // group)
        expected_norms.append(largest_singular_value(bilinear))
        assert records[f"weights/qk_spectral_norm/{name}/head_{index}"] == pytest.approx(
            expected_norms[-1],
            rel=1e-6,  # float64 Gram matrices: float32 rounding of the result alone
        )
        assert records[f"weights/spectral_norm/{name}.q/head_{index}"] == pytest.approx(
            largest_singular_value(head(query, index)), rel=1e-5
        )
    for index in range(layout.key_heads):
        for role, weight in (("k", key), ("v", value)):
            assert records[f"weights/spectral_norm/{name}.{role}/head_{index}"] == pytest.approx(
                largest_singular_value(head(weight, index)), rel=1e-5
            )
    assert f"weights/spectral_norm/{name}.k/head_{layout.key_heads}" not in records
    assert records[f"weights/qk_spectral_norm_max/{name}"] == pytest.approx(max(expected_norms), rel=1e-5)
    # the projections are reported as q, k, v, not also whole under their own names; the output one is whole
    for projection in set(layout.projections) - {"q", "k", "v"}:
        assert f"weights/spectral_norm/{name}.{projection}" not in records
    output = f"{name}.{layout.output}" if not layout.output.startswith("output") else None
    if output is not None:
        assert f"weights/spectral_norm/{output}" in records


def test_the_bert_split_gives_the_heads_the_model_computes() -> None:
    model = bert(attention="eager", seed=1).eval()
    attention = model.encoder.layer[0].attention.self
    seen = {}
    attention.query.register_forward_hook(lambda _, args, output: seen.update(x=args[0]))
    with torch.no_grad():
        attentions = model(torch.randint(0, VOCAB, (2, 6)), output_attentions=True).attentions

    matrices = dict(WeightProbe(model).named_matrices())
    name = "encoder.layer.0.attention.self"
    assert f"{name}.query" not in matrices and f"{name}.q" in matrices
    expected = attention_probabilities(
        seen["x"],
        seen["x"],
        matrices[f"{name}.q"],
        matrices[f"{name}.k"],
        attention.query.bias,
        attention.key.bias,
        4,
    )
    torch.testing.assert_close(attentions[0], expected)  # the same heads, in the same order


def gpt_neox() -> nn.Module:
    config = transformers.GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=VOCAB,
        attention_bias=False,
        attn_implementation="sdpa",
    )
    return transformers.GPTNeoXForCausalLM(config)


def phi3() -> nn.Module:
    config = transformers.Phi3Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=VOCAB,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return transformers.Phi3ForCausalLM(config)


FUSED = {
    "gpt_neox": (gpt_neox, "gpt_neox.layers.0.attention", "query_key_value", 4, 4),
    "phi3": (phi3, "model.layers.0.self_attn", "qkv_proj", 4, 2),
}


def heads_the_module_computes(attention: nn.Module, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's W_Q^h (H, d_k, in) and each query head's W_K^g (H, d_k, in), in float64, from the module's
    own forward: the identity as input, rotary embedding at angle 0 (cos 1, sin 0), so row i of a head's q is
    column i of its W_Q^h. The kernel's k has the grouped key heads repeated per query head."""
    from spectral_monitor.probes import AttentionCapture

    identity = torch.eye(hidden, dtype=torch.float64)[None]
    width = attention.head_size if hasattr(attention, "head_size") else attention.head_dim
    cos = torch.ones(1, hidden, width, dtype=torch.float64)
    sin = torch.zeros(1, hidden, width, dtype=torch.float64)
    with torch.no_grad(), AttentionCapture(attention, strict=True).armed() as recording:
        attention(hidden_states=identity, position_embeddings=(cos, sin), attention_mask=None)
    (captured,) = recording.captured
    return captured.q[0].transpose(1, 2), captured.k[0].transpose(1, 2)


@pytest.mark.parametrize("family", FUSED)
def test_fused_qkv_splits_into_the_heads_the_module_computes_and_each_head_is_measured(family: str) -> None:
    build, name, fused, heads, key_heads = FUSED[family]
    torch.manual_seed(0)
    model = build().eval().double()
    attention = model.get_submodule(name)
    query_heads, key_per_query_head = heads_the_module_computes(attention, 32)

    probe = WeightProbe(model, per_head=True)
    matrices = dict(probe.named_matrices())
    width = query_heads.shape[1]
    assert f"{name}.{fused}" not in matrices  # measured split, not also whole
    assert matrices[f"{name}.q"].shape == (heads * width, 32)
    assert matrices[f"{name}.k"].shape == matrices[f"{name}.v"].shape == (key_heads * width, 32)
    group = heads // key_heads
    for head in range(heads):
        torch.testing.assert_close(
            matrices[f"{name}.q"][head * width : (head + 1) * width], query_heads[head]
        )
        key_head = head // group
        torch.testing.assert_close(
            matrices[f"{name}.k"][key_head * width : (key_head + 1) * width], key_per_query_head[head]
        )

    records = {record.tag: record.value for record in probe.measure(0)}
    expected = [largest_singular_value(query_heads[h].T @ key_per_query_head[h]) for h in range(heads)]
    for head in range(heads):
        assert records[f"weights/qk_spectral_norm/{name}/head_{head}"] == pytest.approx(
            expected[head], rel=1e-6
        )
        assert records[f"weights/spectral_norm/{name}.q/head_{head}"] == pytest.approx(
            largest_singular_value(query_heads[head]), rel=1e-6
        )
    assert f"weights/spectral_norm/{name}.k/head_{key_heads - 1}" in records
    assert f"weights/spectral_norm/{name}.k/head_{key_heads}" not in records
    assert records[f"weights/qk_spectral_norm_max/{name}"] == pytest.approx(max(expected), rel=1e-6)


class FusedAttention(nn.Module):
    """Attention with a fused projection in a layout of its own (a per-head interleaved ``Wqkv``)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 2
        self.Wqkv = nn.Linear(8, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.Wqkv(x).view(*x.shape[:-1], self.n_heads, 3, 4).unbind(-2)
        return torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 2, dim=-1).sum()


def test_an_unknown_fused_layout_is_named_in_one_warning_whose_registration_fixes_it() -> None:
    from spectral_monitor.probes import QKVLayout, register_qkv_layout

    model = nn.Sequential(FusedAttention(), FusedAttention())
    warned: list[str] = []
    probe = WeightProbe(model, warn=warned.append)
    probe.measure(0)
    probe.measure(1)
    (message,) = warned
    assert 'FusedAttention (0) fuses q, k and v in "Wqkv"' in message
    assert 'register_qkv_layout(FusedAttention, QKVLayout("Wqkv", "concatenated"))' in message
    assert not probe.attention_weights()

    with register_qkv_layout(FusedAttention, QKVLayout("Wqkv", "interleaved")):
        warned.clear()
        probe = WeightProbe(model, warn=warned.append)
        records = {record.tag: record.value for record in probe.measure(0)}
        assert not warned
        assert (
            "weights/qk_spectral_norm/0/head_1" in records and "weights/spectral_norm/0.Wqkv" not in records
        )
        (name, weights), _ = probe.attention_weights()
        rows = model[0].Wqkv.weight.detach().view(2, 3, 4, 8)
        torch.testing.assert_close(weights.query, rows[:, 0].reshape(8, 8))
        torch.testing.assert_close(weights.key, rows[:, 1].reshape(8, 8))
    assert not WeightProbe(model, warn=warned.append).attention_weights()  # unregistered on exit


class NanoAttention(nn.Module):
    """nanoGPT's attention with its head count under a name of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.h = 2
        self.c_attn = nn.Linear(8, 24)


def test_a_packed_projection_without_a_known_head_count_says_which_attribute_to_name() -> None:
    from spectral_monitor.probes import AttentionFamilies

    model = nn.Sequential(NanoAttention())
    warned: list[str] = []
    probe = WeightProbe(model, warn=warned.append)
    assert "weights/spectral_norm/0.c_attn" in {record.tag for record in probe.measure(0)}  # measured whole
    (message,) = warned
    assert 'NanoAttention (0) fuses q, k and v in "c_attn": no per-head weight metrics' in message
    assert "its head count, which it holds under none of n_head, n_heads, num_heads" in message
    assert 'AttentionFamilies().with_attribute_names(head_count=["..."])' in message
    named = AttentionFamilies().with_attribute_names(head_count=["h"])
    warned.clear()
    probe = WeightProbe(model, warn=warned.append, attention_families=named)
    records = {record.tag for record in probe.measure(0)}
    assert not warned and "weights/qk_spectral_norm/0/head_1" in records
    ((_, weights),) = probe.attention_weights()
    torch.testing.assert_close(weights.query, model[0].c_attn.weight.detach()[:8])


def test_a_qkv_layout_refuses_what_it_cannot_mean() -> None:
    from spectral_monitor.probes import QKVLayout, register_qkv_layout

    with pytest.raises(ValueError, match="layout must be one of"):
        QKVLayout("qkv", "packed")
    with pytest.raises(ValueError, match="projection"):
        QKVLayout("", "interleaved")
    with pytest.raises(ValueError, match="num_heads"):
        QKVLayout("qkv", "interleaved", num_heads=0)
    with pytest.raises(ValueError, match="target"):
        register_qkv_layout(3, QKVLayout("qkv", "interleaved"))
