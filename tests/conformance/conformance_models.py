"""One builder per model family written outside this project, for the conformance suite.

Each builds a tiny random-init model (no download; the Hugging Face ones from ``helpers.hf_models``), its
padding cases and an independent float64 reference (``conformance_harness.Family``). Dropout is off so that
train mode (the monitored forward) and the reference forward compute the same thing; the query and key
projections are scaled up so attention is far from uniform.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from conformance_harness import (
    BlockReference,
    Family,
    LayerReference,
    LogitInputs,
    as_float64,
    sharpen_attention,
)
from helpers.hf_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_mistral, tiny_t5
from torch import Tensor, nn

from spectral_monitor.probes import AttentionInputs

VOCAB = 64
BATCH_LENGTHS = {
    # Real tokens per sequence of a batch of three: no padding, one fully padded, one single-token sequence.
    "no_padding": (6, 6, 6),
    "right_padding": (6, 4, 2),
    "left_padding": (6, 4, 2),
    "fully_padded_sequence": (6, 0, 3),
    "single_token_sequence": (6, 1, 4),
}
TOKENS = 6


def token_mask_of(case: str, tokens: int = TOKENS, lengths: tuple[int, ...] | None = None) -> Tensor:
    """(3, tokens) int64 attention mask of a case: 1 = real token; padding on the left for left_padding."""
    lengths = BATCH_LENGTHS[case] if lengths is None else lengths
    positions = torch.arange(tokens)
    if case == "left_padding":
        return torch.stack([(positions >= tokens - length).long() for length in lengths])
    return torch.stack([(positions < length).long() for length in lengths])


def _token_cases(cases: tuple[str, ...], seed: int) -> dict[str, dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        case: {
            "input_ids": torch.randint(1, VOCAB, (3, TOKENS), generator=generator),
            "attention_mask": token_mask_of(case),
        }
        for case in cases
    }


def _block_outputs(blocks: list[tuple[str, nn.Module]]) -> tuple[dict[str, Tensor], list]:
    """Forward hooks keeping each block's output (its first tensor), and their handles."""
    outputs: dict[str, Tensor] = {}

    def keep(name: str):
        def hook(module: nn.Module, args: object, output: object) -> None:
            outputs[name] = output[0] if isinstance(output, tuple) else output

        return hook

    return outputs, [module.register_forward_hook(keep(name)) for name, module in blocks]


def _eager_twin(model: nn.Module, **options: object) -> nn.Module:
    config = copy.deepcopy(model.config)
    twin = type(model)._from_config(config, attn_implementation="eager", **options)
    twin.load_state_dict(model.state_dict())
    return twin.train()


def _hf_causal_lm_family(
    name: str,
    model: nn.Module,
    blocks: str,
    attention: str,
    seed: int,
    qkv_projection: str | None = None,
    window: int | None = None,
) -> Family:
    """``qkv_projection``: the attention's fused q, k, v projection (GPT-2's ``c_attn``), whose output gives
    the reference q and k of the logit metrics; without it they are not checked. ``window``: the model's
    sliding window (query i attends keys j > i − window)."""
    twin = _eager_twin(model)
    block_modules = [(f"model.{blocks}.{index}", module) for index, module in enumerate(_get(twin, blocks))]
    projections = (
        []
        if qkv_projection is None
        else [_get(block, f"{attention}.{qkv_projection}") for block in _get(twin, blocks)]
    )

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).logits.float().square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        real = batch["attention_mask"].bool().numpy()
        outputs, handles = _block_outputs(block_modules)
        projected, projection_handles = _block_outputs(
            [(str(index), projection) for index, projection in enumerate(projections)]
        )
        with torch.no_grad():
            attentions = twin(**batch, output_attentions=True).attentions
        for handle in handles + projection_handles:
            handle.remove()
        layer_references = [
            LayerReference(
                f"model.{blocks}.{index}.{attention}",
                as_float64(probs),
                real,
                real,
                causal=True,
                logit_inputs=None
                if qkv_projection is None
                else _fused_logit_inputs(projected[str(index)], probs.shape[1]),
                window=window,
            )
            for index, probs in enumerate(attentions)
        ]
        block_references = [
            BlockReference(name, as_float64(outputs[name]), real) for name, _ in block_modules
        ]
        return layer_references, block_references

    cases = _token_cases(tuple(BATCH_LENGTHS), seed=seed)
    return Family(name, model, loss, cases, reference)


def _fused_logit_inputs(qkv: Tensor, heads: int) -> LogitInputs:
    """q and k in float64 (B, H, n, d) from a fused projection's output (B, n, 3 · H · d), scale 1/√d."""
    q, k, _ = qkv.detach().double().chunk(3, dim=-1)
    q, k = (t.view(*t.shape[:2], heads, -1).transpose(1, 2).numpy() for t in (q, k))
    return LogitInputs(q, k, 1.0 / math.sqrt(q.shape[-1]))


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def gpt2_family() -> Family:
    model = tiny_gpt2(head="causal_lm", vocab_size=VOCAB)
    sharpen_attention(model, ("c_attn.weight",), 25.0)
    return _hf_causal_lm_family("gpt2", model, "transformer.h", "attn", 1, qkv_projection="c_attn")


def llama_family() -> Family:
    model = tiny_llama(head="causal_lm", vocab_size=VOCAB)
    sharpen_attention(model, ("q_proj.weight", "k_proj.weight"), 25.0)
    return _hf_causal_lm_family("llama", model, "model.layers", "self_attn", 2)


def mistral_family() -> Family:
    """A sliding window of 3 keys over 6 tokens: the eager twin's masks, not the monitor's, say which keys a
    row attends."""
    model = tiny_mistral(head="causal_lm", vocab_size=VOCAB)
    sharpen_attention(model, ("q_proj.weight", "k_proj.weight"), 25.0)
    return _hf_causal_lm_family("mistral", model, "model.layers", "self_attn", 9, window=3)


def bert_family() -> Family:
    model = tiny_bert(vocab_size=VOCAB)
    sharpen_attention(model, ("query.weight", "key.weight"), 25.0)
    twin = _eager_twin(model)
    block_modules = [
        (f"model.encoder.layer.{index}", layer) for index, layer in enumerate(twin.encoder.layer)
    ]

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).last_hidden_state.square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        real = batch["attention_mask"].bool().numpy()
        outputs, handles = _block_outputs(block_modules)
        with torch.no_grad():
            attentions = twin(**batch, output_attentions=True).attentions
        for handle in handles:
            handle.remove()
        layers = [
            LayerReference(
                f"model.encoder.layer.{index}.attention.self", as_float64(probs), real, real, False
            )
            for index, probs in enumerate(attentions)
        ]
        return layers, [BlockReference(name, as_float64(outputs[name]), real) for name, _ in block_modules]

    cases = ("no_padding", "right_padding", "fully_padded_sequence", "single_token_sequence")
    return Family("bert", model, loss, _token_cases(cases, seed=3), reference)


def vit_family() -> Family:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=12,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = ViTModel(config, add_pooling_layer=False)
    sharpen_attention(model, ("q_proj.weight", "k_proj.weight"), 25.0)
    twin = _eager_twin(model, add_pooling_layer=False)
    layer_names = [f"layers.{index}.attention" for index in range(config.num_hidden_layers)]
    block_modules = [(f"model.layers.{index}", block) for index, block in enumerate(twin.layers)]

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).last_hidden_state.square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        outputs, handles = _block_outputs(block_modules)
        with torch.no_grad():
            attentions = twin(**batch, output_attentions=True).attentions
        for handle in handles:
            handle.remove()
        tokens = attentions[0].shape[-1]
        real = np.ones((batch["pixel_values"].shape[0], tokens), dtype=bool)
        layers = [
            LayerReference(f"model.{name}", as_float64(probs), real, real, causal=False)
            for name, probs in zip(layer_names, attentions, strict=True)
        ]
        return layers, [BlockReference(name, as_float64(outputs[name]), real) for name, _ in block_modules]

    images = torch.randn(3, 3, 12, 12, generator=torch.Generator().manual_seed(4))
    return Family("vit", model, loss, {"no_padding": {"pixel_values": images}}, reference)


def t5_family() -> Family:
    model = tiny_t5(head="seq2seq_lm", vocab_size=VOCAB)
    sharpen_attention(model, (".q.weight", ".k.weight"), 4.0)
    twin = _eager_twin(model)
    block_modules = [
        (f"model.encoder.block.{index}", block) for index, block in enumerate(twin.encoder.block)
    ]
    block_modules += [
        (f"model.decoder.block.{index}", block) for index, block in enumerate(twin.decoder.block)
    ]
    decoder_tokens = 5  # cross-attention: 5 queries x 6 keys

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).logits.float().square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        source = batch["attention_mask"].bool().numpy()
        target = batch["decoder_attention_mask"].bool().numpy()
        outputs, handles = _block_outputs(block_modules)
        with torch.no_grad():
            result = twin(**batch, output_attentions=True)
        for handle in handles:
            handle.remove()
        layers = []
        for index, probs in enumerate(result.encoder_attentions):
            layers.append(
                LayerReference(
                    f"model.encoder.block.{index}.layer.0.SelfAttention",
                    as_float64(probs),
                    source,
                    source,
                    False,
                )
            )
        for index, probs in enumerate(result.decoder_attentions):
            layers.append(
                LayerReference(
                    f"model.decoder.block.{index}.layer.0.SelfAttention",
                    as_float64(probs),
                    target,
                    target,
                    True,
                )
            )
        for index, probs in enumerate(result.cross_attentions):
            layers.append(
                LayerReference(
                    f"model.decoder.block.{index}.layer.1.EncDecAttention",
                    as_float64(probs),
                    target,
                    source,
                    False,
                )
            )
        blocks = [
            BlockReference(name, as_float64(outputs[name]), source if ".encoder." in name else target)
            for name, _ in block_modules
        ]
        return layers, blocks

    generator = torch.Generator().manual_seed(5)
    target_lengths = {
        "no_padding": (5, 5, 5),
        "right_padding": (5, 3, 2),
        "fully_padded_sequence": (5, 0, 3),
        "single_token_sequence": (5, 1, 4),
    }
    cases = {
        case: {
            "input_ids": torch.randint(2, VOCAB, (3, TOKENS), generator=generator),
            "attention_mask": token_mask_of(case),
            "decoder_input_ids": torch.randint(2, VOCAB, (3, decoder_tokens), generator=generator),
            "decoder_attention_mask": token_mask_of(case, decoder_tokens, lengths),
        }
        for case, lengths in target_lengths.items()
    }
    return Family("t5", model, loss, cases, reference)


class _EncoderDecoder(nn.Module):
    """``nn.Transformer`` with a causal target mask and the batch's three padding masks."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=32,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=64,
            dropout=0.0,
            batch_first=True,
        )

    def forward(
        self, source: Tensor, target: Tensor, source_padding: Tensor, target_padding: Tensor
    ) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        return self.transformer(
            source,
            target,
            tgt_mask=causal,
            src_key_padding_mask=source_padding,
            tgt_key_padding_mask=target_padding,
            memory_key_padding_mask=source_padding,
        )


def nn_transformer_family() -> Family:
    torch.manual_seed(0)
    model = _EncoderDecoder()
    sharpen_attention(model, ("in_proj_weight",), 3.0)
    twin = copy.deepcopy(model).train()
    attention_modules = [
        (f"model.transformer.{name}", module)
        for name, module in twin.transformer.named_modules()
        if isinstance(module, nn.MultiheadAttention)
    ]
    block_modules = [
        (f"model.transformer.{name}", module)
        for name, module in twin.transformer.named_modules()
        if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    ]

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        # The kernel's own weights: each MultiheadAttention called again with need_weights on its inputs.
        probabilities: dict[str, Tensor] = {}

        def weights_of(name: str):
            def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
                call = dict(kwargs, need_weights=True, average_attn_weights=False)
                probabilities[name] = module.forward(*args, **call)[1]

            return hook

        handles = [
            module.register_forward_pre_hook(weights_of(name), with_kwargs=True)
            for name, module in attention_modules
        ]
        outputs, block_handles = _block_outputs(block_modules)
        with torch.no_grad():
            twin(**batch)
        for handle in handles + block_handles:
            handle.remove()
        source = (~batch["source_padding"]).numpy()
        target = (~batch["target_padding"]).numpy()
        layers = []
        for name, _ in attention_modules:
            cross = name.endswith("multihead_attn")
            queries = source if ".encoder." in name else target
            keys = source if ".encoder." in name or cross else target
            causal = ".decoder." in name and not cross
            layers.append(LayerReference(name, as_float64(probabilities[name]), queries, keys, causal))
        blocks = [
            BlockReference(name, as_float64(outputs[name]), source if ".encoder." in name else target)
            for name, _ in block_modules
        ]
        return layers, blocks

    generator = torch.Generator().manual_seed(6)
    target_tokens = 5
    target_lengths = {
        "no_padding": (5, 5, 5),
        "right_padding": (5, 3, 2),
        "left_padding": (5, 3, 2),
        "fully_padded_sequence": (5, 0, 3),
        "single_token_sequence": (5, 1, 4),
    }
    cases = {
        case: {
            "source": torch.randn(3, TOKENS, 32, generator=generator),
            "target": torch.randn(3, target_tokens, 32, generator=generator),
            "source_padding": token_mask_of(case) == 0,
            "target_padding": token_mask_of(case, target_tokens, lengths) == 0,
        }
        for case, lengths in target_lengths.items()
    }
    return Family("nn_transformer", model, loss, cases, reference)


class NanoCausalSelfAttention(nn.Module):
    """nanoGPT's attention: one projection to q, k, v, then causal SDPA with dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, tokens, width))


class NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = NanoCausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(TOKENS, width)
        self.h = nn.ModuleList(NanoBlock(width, heads) for _ in range(layers))
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def nanogpt_family() -> Family:
    """is_causal SDPA takes no padding mask, so padding is told with SpectralMonitor(token_mask=...)."""
    torch.manual_seed(0)
    model = NanoGPT()
    sharpen_attention(model, ("c_attn.weight",), 3.0)
    twin = copy.deepcopy(model).train()

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(batch["input_ids"]).square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        # The kernel's inputs recomputed in float64 from each attention module's input.
        inputs: dict[str, Tensor] = {}
        handles = []
        for index, block in enumerate(twin.h):
            handles.append(block.attn.register_forward_pre_hook(_keep_input(inputs, f"model.h.{index}.attn")))
        outputs, block_handles = _block_outputs(
            [(f"model.h.{index}", block) for index, block in enumerate(twin.h)]
        )
        with torch.no_grad():
            twin(batch["input_ids"])
        for handle in handles + block_handles:
            handle.remove()
        real = batch["attention_mask"].bool().numpy()
        layers = []
        for index, block in enumerate(twin.h):
            name = f"model.h.{index}.attn"
            x = inputs[name].detach().double()
            weight, bias = (
                block.attn.c_attn.weight.detach().double(),
                block.attn.c_attn.bias.detach().double(),
            )
            q, k, _ = F.linear(x, weight, bias).split(x.shape[-1], dim=2)
            q, k = (t.view(*x.shape[:2], block.attn.heads, -1).transpose(1, 2) for t in (q, k))
            logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            logits = logits.masked_fill(
                ~torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(), -math.inf
            )
            layers.append(
                LayerReference(
                    name,
                    logits.softmax(dim=-1).numpy(),
                    real,
                    real,
                    causal=True,
                    logit_inputs=LogitInputs(q.numpy(), k.numpy(), 1.0 / math.sqrt(q.shape[-1])),
                )
            )
        blocks = [BlockReference(name, as_float64(outputs[name]), real) for name in outputs]
        return layers, blocks

    cases = _token_cases(("no_padding", "right_padding", "fully_padded_sequence", "single_token_sequence"), 7)
    return Family("nanogpt", model, loss, cases, reference, token_mask=lambda batch: batch["attention_mask"])


def _keep_input(inputs: dict[str, Tensor], name: str):
    def hook(module: nn.Module, args: tuple) -> None:
        inputs[name] = args[0]

    return hook


class HandWrittenAttention(nn.Module):
    """Bidirectional attention computed by hand (no attention kernel the monitor could see)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.query, self.key = nn.Linear(width, width), nn.Linear(width, width)
        self.value, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.kept_probs: Tensor | None = None  # set by a caller that wants the probabilities

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            projection(x).view(batch, tokens, self.heads, -1).transpose(1, 2)
            for projection in (self.query, self.key, self.value)
        )
        logits = (q @ k.transpose(-1, -2)) * self.scale
        logits = logits.masked_fill(~padding_mask[:, None, None, :], torch.finfo(logits.dtype).min)
        probs = logits.softmax(dim=-1)
        if self.kept_probs is not None:
            self.kept_probs = probs.detach()
        return self.out((probs @ v).transpose(1, 2).reshape(batch, tokens, width))


class HandWrittenBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = HandWrittenAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        x = x + self.attention(self.norm_1(x), padding_mask)
        return x + self.mlp(self.norm_2(x))


class HandWrittenEncoder(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(HandWrittenBlock(width, heads) for _ in range(layers))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, attention_mask.bool())
        return x


def hand_written_extractor(
    module: HandWrittenAttention, args: tuple, kwargs: dict, output: Tensor
) -> AttentionInputs:
    """The extractor of the documentation's example: q, k and the key padding of a hand-written layer."""
    x, padding_mask = args
    batch, tokens, _ = x.shape
    q, k = (
        projection(x).view(batch, tokens, module.heads, -1).transpose(1, 2)
        for projection in (module.query, module.key)
    )
    return AttentionInputs(q=q, k=k, mask=padding_mask[:, None, None, :], scale=module.scale)


def extractor_family() -> Family:
    """Attention written by hand, seen through ``hand_written_extractor`` registered while the family runs."""
    torch.manual_seed(0)
    model = HandWrittenEncoder()
    sharpen_attention(model, ("query.weight", "key.weight"), 4.0)
    twin = copy.deepcopy(model).train()
    block_modules = [(f"model.blocks.{index}", block) for index, block in enumerate(twin.blocks)]

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return model(**batch).square().mean()

    def reference(batch: dict[str, Tensor]) -> tuple[list[LayerReference], list[BlockReference]]:
        for block in twin.blocks:
            block.attention.kept_probs = torch.empty(0)
        outputs, handles = _block_outputs(block_modules)
        with torch.no_grad():
            twin(**batch)
        for handle in handles:
            handle.remove()
        real = batch["attention_mask"].bool().numpy()
        layers = [
            LayerReference(
                f"model.blocks.{index}.attention", as_float64(block.attention.kept_probs), real, real, False
            )
            for index, block in enumerate(twin.blocks)
        ]
        return layers, [BlockReference(name, as_float64(outputs[name]), real) for name, _ in block_modules]

    cases = _token_cases(tuple(BATCH_LENGTHS), seed=8)
    return Family(
        "hand_written",
        model,
        loss,
        cases,
        reference,
        extractors={HandWrittenAttention: hand_written_extractor},
    )


FAMILIES = {
    "GPT-2 (HF sdpa)": gpt2_family,
    "Llama (HF sdpa, GQA, RoPE)": llama_family,
    "Mistral (HF sdpa, sliding window)": mistral_family,
    "BERT (HF sdpa)": bert_family,
    "T5 (HF sdpa, relative bias)": t5_family,
    "ViT (HF sdpa)": vit_family,
    "nn.Transformer": nn_transformer_family,
    "nanoGPT (SDPA is_causal)": nanogpt_family,
    "hand-written attention (extractor)": extractor_family,
}
