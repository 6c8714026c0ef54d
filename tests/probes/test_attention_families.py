"""The registry of attention-family knowledge: how modules are recognised, counted and read, how a
registry is extended without changing another, and how each reader (the weight probe, the attention
capture's token masks, the preflight, the advice) reads with the registry it is given."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers.models import HEADS, TOKENS, VOCAB, WIDTH, FusedHeadsAttention, FusedHeadsModel
from torch import nn

from spectral_monitor.probes import (
    AttentionCapture,
    AttentionFamilies,
    QKVLayout,
    WeightProbe,
    register_qkv_layout,
)
from spectral_monitor.probes.attention_families import (
    ATTENTION_CLASS_NAME_PARTS,
    BUILT_IN_QKV_LAYOUTS,
    HEAD_COUNT_ATTRIBUTES,
    HEAD_WIDTH_ATTRIBUTES,
    KEY_VALUE_HEAD_COUNT_ATTRIBUTES,
    MODEL_WIDTH_ATTRIBUTES,
    PADDING_MASK_KEYWORDS,
    REAL_TOKEN_MASK_KEYWORDS,
    qkv_layout_pattern,
)
from spectral_monitor.probes.attention_weights import fused_projection_name
from spectral_monitor.probes.huggingface import attention_not_seen_advice
from spectral_monitor.probes.wrappers import data_parallel_unwrapped
from spectral_monitor.toolbox.preflight import architecture_preflight


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
    families = AttentionFamilies()
    assert families.looks_like_attention(HandWrittenAttention())
    assert not families.looks_like_attention(nn.MultiheadAttention(8, 2))  # its kernel call is always seen
    assert not families.looks_like_attention(nn.Linear(2, 2))


def test_the_first_positive_int_attribute_is_the_declared_count():
    module = nn.Module()
    module.n_head = None
    module.num_heads = 4
    module.embed_dim = 0
    module.hidden_size = 32
    families = AttentionFamilies()
    assert families.declared_head_count(module) == 4
    assert families.declared_model_width(module) == 32
    assert families.declared_head_count(nn.Linear(2, 2)) is None


def test_a_fused_projection_is_read_only_once_its_layout_is_registered():
    module = HandWrittenAttention()
    assert AttentionFamilies().read_attention_weights("attention", module) is None
    assert fused_projection_name(module) == "Wqkv"
    with register_qkv_layout("*.attention", QKVLayout("Wqkv", "concatenated")):
        families = AttentionFamilies()
        assert families.read_attention_weights("other", module) is None  # no class or module name matches
        weights = families.read_attention_weights("blocks.0.attention", module)
        assert weights is not None and weights.num_heads == 2 and weights.replaces == ("Wqkv",)
        assert torch.equal(weights.key, module.Wqkv.weight.detach()[8:16])
    assert AttentionFamilies().read_attention_weights("blocks.0.attention", module) is None  # unregistered
    assert families.read_attention_weights("blocks.0.attention", module) is not None  # made before: kept


def test_only_data_parallel_wrappers_are_seen_through_by_the_plain_loop():
    model = Block()
    assert data_parallel_unwrapped(model) is model
    compiled = torch.compile(model)
    assert data_parallel_unwrapped(compiled) is compiled  # how a compiled model is called decides its probe


# -- the registry as a value ------------------------------------------------------------------------------


def test_the_default_registry_holds_the_documented_names_and_the_built_in_layouts():
    families = AttentionFamilies()
    assert families.head_count_attributes == HEAD_COUNT_ATTRIBUTES
    assert families.key_value_head_count_attributes == KEY_VALUE_HEAD_COUNT_ATTRIBUTES
    assert families.head_width_attributes == HEAD_WIDTH_ATTRIBUTES
    assert families.model_width_attributes == MODEL_WIDTH_ATTRIBUTES
    assert families.real_token_mask_keywords == REAL_TOKEN_MASK_KEYWORDS
    assert families.padding_mask_keywords == PADDING_MASK_KEYWORDS
    assert families.attention_class_name_parts == ATTENTION_CLASS_NAME_PARTS
    assert families.qkv_layouts == dict(BUILT_IN_QKV_LAYOUTS)
    assert families == AttentionFamilies() and pickle.loads(pickle.dumps(families)) == families


def test_extending_gives_a_new_registry_whose_additions_are_tried_first():
    base = AttentionFamilies()
    first, second = QKVLayout("Wqkv", "concatenated"), QKVLayout("Wqkv", "interleaved")
    extended = (
        base.with_attribute_names(head_count=["n_q_heads"], model_width=["width"])
        .with_mask_keywords(real_tokens=["keep"], padding=["pad_mask"])
        .with_attention_class_names("Mixer")
        .with_qkv_layout(FusedHeadsAttention, first)
        .with_qkv_layout("*.attn", second)
        .with_qkv_layout(FusedHeadsAttention, second)
    )
    assert base == AttentionFamilies()  # left as it was
    assert extended.head_count_attributes == ("n_q_heads", *HEAD_COUNT_ATTRIBUTES)
    assert extended.model_width_attributes == ("width", *MODEL_WIDTH_ATTRIBUTES)
    assert extended.real_token_mask_keywords == ("keep", *REAL_TOKEN_MASK_KEYWORDS)
    assert extended.padding_mask_keywords == ("pad_mask", *PADDING_MASK_KEYWORDS)
    assert extended.attention_class_name_parts == ("Mixer", *ATTENTION_CLASS_NAME_PARTS)
    # Registered again, a target moves to the end: it wins over "*.attn" registered in between.
    assert list(extended.qkv_layouts)[-2:] == ["*.attn", qkv_layout_pattern(FusedHeadsAttention)]
    assert extended.qkv_layout_of("blocks.0.attn", FusedHeadsAttention()) is second
    assert extended.qkv_layout_of("blocks.0.attn", nn.Linear(2, 2)) is second  # by its qualified name
    assert extended.qkv_layout_of("Phi3Attention", nn.Linear(2, 2)) is BUILT_IN_QKV_LAYOUTS["Phi3Attention"]


REFUSED = {
    "names-as-str": (lambda: AttentionFamilies(head_count_attributes="n_head"), "head_count_attributes"),
    "name-int": (lambda: AttentionFamilies(padding_mask_keywords=["pad", 3]), "padding_mask_keywords"),
    "layouts-list": (
        lambda: AttentionFamilies(qkv_layouts=[("X", QKVLayout("a", "interleaved"))]),
        "qkv_layouts",
    ),
    "layout-target-int": (
        lambda: AttentionFamilies(qkv_layouts={3: QKVLayout("a", "interleaved")}),
        "qkv_layouts",
    ),
    "layout-dict": (
        lambda: AttentionFamilies(qkv_layouts={"X": {"projection": "a"}}),
        "qkv_layouts: the layout",
    ),
    "added-empty": (lambda: AttentionFamilies().with_attribute_names(head_count=[""]), "head_count"),
    "added-str": (lambda: AttentionFamilies().with_mask_keywords(padding="pad"), "padding"),
    "part-none": (lambda: AttentionFamilies().with_attention_class_names(None), "parts"),
    "target-instance": (
        lambda: AttentionFamilies().with_qkv_layout(nn.Linear(2, 2), QKVLayout("a", "concatenated")),
        "target",
    ),
    "probe": (lambda: WeightProbe(nn.Linear(2, 2), attention_families={}), "attention_families"),
}


@pytest.mark.parametrize(("make", "named"), list(REFUSED.values()), ids=list(REFUSED))
def test_a_registry_refuses_what_it_cannot_mean_naming_the_argument(make, named: str) -> None:
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value).startswith(named), str(raised.value)


# -- each reader reads with the registry it is given ------------------------------------------------------


def test_a_custom_head_count_attribute_lets_a_packed_projection_split_into_its_heads():
    module = nn.Module()
    module.n_q_heads = 4
    module.qkv = nn.Linear(16, 48, bias=False)
    assert AttentionFamilies().read_attention_weights("attn", module) is None  # no head count it knows
    weights = (
        AttentionFamilies()
        .with_attribute_names(head_count=["n_q_heads"])
        .read_attention_weights("attn", module)
    )
    assert weights is not None and weights.num_heads == 4 and weights.replaces == ("qkv",)
    assert torch.equal(weights.value, module.qkv.weight.detach()[32:])


def test_a_layout_given_to_one_weight_probe_splits_its_heads_and_no_other_probes():
    model = FusedHeadsModel()
    families = AttentionFamilies().with_qkv_layout(FusedHeadsAttention, QKVLayout("Wqkv", "interleaved"))
    families = families.with_attribute_names(head_count=["n_q_heads"])  # the layout leaves the count to it
    warned: list[str] = []
    split = {
        r.tag: r.value for r in WeightProbe(model, attention_families=families, warn=warned.append).measure(0)
    }
    whole = {r.tag: r.value for r in WeightProbe(model, warn=warned.append).measure(0)}

    rows = model.blocks[0]["attn"].Wqkv.weight.detach().double().view(HEADS, 3, WIDTH // HEADS, WIDTH)
    for head in range(HEADS):
        query, key = rows[head, 0], rows[head, 1]
        for role, weight in (("q", query), ("k", key), ("v", rows[head, 2])):
            expected = torch.linalg.svdvals(weight)[0].item()
            got = split[f"weights/spectral_norm/blocks.0.attn.{role}/head_{head}"]
            assert got == pytest.approx(expected, rel=1e-5)
        expected = torch.linalg.svdvals(query.T @ key)[0].item()
        assert split[f"weights/qk_spectral_norm/blocks.0.attn/head_{head}"] == pytest.approx(
            expected, rel=1e-5
        )
    assert "weights/spectral_norm/blocks.0.attn.Wqkv" not in split
    assert (
        not any("qk_spectral_norm" in tag for tag in whole)
        and "weights/spectral_norm/blocks.0.attn.Wqkv" in whole
    )
    (warning,) = warned  # only the probe without the layout warns
    assert "attention_families=AttentionFamilies().with_qkv_layout(FusedHeadsAttention, " in warning
    assert "and its head count, which it holds under none of n_head" in warning  # n_q_heads: its own name


def test_a_custom_padding_keyword_of_the_forward_marks_the_padded_queries():
    model = FusedHeadsModel()
    tokens = torch.randint(VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    pad_mask = torch.zeros(2, TOKENS, dtype=torch.bool)
    pad_mask[1, 5:] = True
    families = AttentionFamilies().with_mask_keywords(padding=["pad_mask"])
    query_masks = []
    for capture in (AttentionCapture(model, attention_families=families), AttentionCapture(model)):
        with capture.armed() as recording:
            model(tokens, pad_mask=pad_mask)
        (captured,) = recording.captured
        query_masks.append(captured.query_mask)
    read, unread = query_masks
    assert torch.equal(read, ~pad_mask) and unread is None


def test_the_preflight_counts_heads_by_the_names_it_is_given():
    model = FusedHeadsModel()
    model.blocks[0]["mixer"] = nn.Module()
    model.blocks[0]["mixer"].n_q_heads, model.blocks[0]["mixer"].embed_dim = 3, WIDTH
    families = (
        AttentionFamilies()
        .with_attribute_names(head_count=["n_q_heads"])
        .with_qkv_layout(FusedHeadsAttention, QKVLayout("Wqkv", "interleaved"))
    )
    found = {
        (f.check, f.where): f.message for f in architecture_preflight(model, attention_families=families)
    }
    assert found[("heads", "blocks.0.mixer")].startswith(f"width {WIDTH} is not divisible by 3 heads")
    assert found[("head_dim", "blocks.0.attn")].startswith(f"d_k = {WIDTH // HEADS} ({HEADS} heads)")
    unnamed = {(f.check, f.where): f.message for f in architecture_preflight(model)}
    assert ("heads", "blocks.0.mixer") not in unnamed and ("head_dim", "blocks.0.attn") not in unnamed
    assert 'fuses q, k and v in "Wqkv"' in unnamed[("qkv_layout", "model")]  # a finding, not a warning


def test_the_advice_names_the_modules_the_registry_says_look_like_attention():
    model = nn.Sequential(nn.Linear(4, 4))
    model.append(type("TokenMixer", (nn.Module,), {})())
    assert "TokenMixer" not in attention_not_seen_advice(model)
    advice = attention_not_seen_advice(model, AttentionFamilies().with_attention_class_names("mixer"))
    assert "register_attention_extractor(TokenMixer, extractor)" in advice
