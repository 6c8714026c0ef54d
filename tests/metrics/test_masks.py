"""What attention masks and padding mean: causal patterns given as masks, rows normalised by their own keys,
padded queries left out, and sequences with nothing to measure reported as such, never as NaN."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.reference_metrics import attention_reference, row_softmax
from torch import nn

from spectral_monitor import SpectralMonitor
from spectral_monitor.metrics import attention_metrics, token_metrics
from spectral_monitor.metrics.masks import additive_mask, attendable_pattern, is_causal_pattern
from spectral_monitor.probes import AttentionCapture, AttentionInputs
from spectral_monitor.probes.token_masks import ForwardTokenMasks

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp_logits(n: int, m: int, seed: int = 0) -> np.ndarray:
    return 3.0 * np.random.default_rng(seed).standard_normal((n, m))


def test_causal_attention_given_as_a_mask_is_measured_as_causal():
    n = 8
    probs = row_softmax(sharp_logits(n, n), causal=True)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    result = attention_metrics(torch.tensor(probs), attendable=tril, method="exact")
    expected = attention_reference(probs, causal=True)
    assert result["entropy"].item() == pytest.approx(expected["entropy"], abs=1e-12)
    assert math.isnan(result["eigen_gap"].item())  # a triangular matrix's eigenvalues are its diagonal
    non_causal = attention_reference(probs)["entropy"]  # log(all keys): the reading this replaces
    assert abs(non_causal - expected["entropy"]) > 0.05


def test_each_row_is_normalised_by_its_own_attendable_keys():
    n, window = 10, 3
    positions = torch.arange(n)
    band = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < window)
    logits = sharp_logits(n, n, seed=1)
    logits[~band.numpy()] = -np.inf
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    result = attention_metrics(torch.tensor(probs), attendable=band, method="exact")
    expected = attention_reference(probs, attendable=band.numpy())
    assert result["entropy"].item() == pytest.approx(expected["entropy"], abs=1e-12)
    assert math.isnan(result["eigen_gap"].item())  # a sliding window is lower-triangular: causal


def test_is_causal_pattern_reads_real_queries_only():
    n = 5
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    assert is_causal_pattern(tril)
    assert not is_causal_pattern(torch.ones(n, n, dtype=torch.bool))
    # One token per sequence attends only itself: lower and upper triangular at once, not called causal.
    assert not is_causal_pattern(torch.eye(n, dtype=torch.bool))
    # Left padding as Hugging Face unmasks it: padded rows may attend every key, real rows are causal.
    left_padded = tril.clone()
    left_padded[:2] = True
    real = torch.tensor([False, False, True, True, True])
    assert not is_causal_pattern(left_padded)
    assert is_causal_pattern(left_padded, real)


def test_float_masks_block_at_their_dtype_minimum_and_keep_finite_biases():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        bias = torch.tensor([[0.5, -2.0, torch.finfo(dtype).min, -math.inf]], dtype=dtype)
        additive = additive_mask(bias)
        assert torch.isneginf(additive[0, 2:]).all()
        assert torch.equal(additive[0, :2], bias[0, :2].float())  # relative-position bias, ALiBi: logits
        assert attendable_pattern(additive, False, (1, 4)).tolist() == [[True, True, False, False]]
    padding = torch.tensor([[False, True]])  # PyTorch's key_padding_mask: True = masked
    assert torch.isneginf(additive_mask(padding, true_means_masked=True)).tolist() == [[False, True]]


def test_a_sequence_with_nothing_to_measure_is_not_measurable_not_broken():
    probs = torch.tensor(row_softmax(sharp_logits(2 * 6, 6).reshape(2, 6, 6)))
    no_query = torch.tensor([[True] * 6, [False] * 6])
    result = attention_metrics(probs, query_mask=no_query, method="exact")
    assert not result["nonfinite"].any()
    for name, value in result.items():
        if value.is_floating_point():
            assert math.isnan(value[1].item()), name
    states = torch.randn(2, 6, 8)
    tokens = token_metrics(states, token_mask=no_query)
    assert not tokens["nonfinite"].any()
    assert all(math.isnan(value[1].item()) for name, value in tokens.items() if name != "nonfinite")
    assert not any(math.isnan(value[0].item()) for name, value in tokens.items() if name != "nonfinite")


def test_multihead_attention_with_a_causal_attn_mask_is_measured_as_causal():
    torch.manual_seed(0)
    n, width = 8, 16
    attention = nn.MultiheadAttention(width, 2, batch_first=True)
    with torch.no_grad():
        attention.in_proj_weight.mul_(4.0)
    x = torch.randn(2, n, width)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked, with is_causal left False
    capture = AttentionCapture(attention)
    with capture.armed() as recording:
        attention(x, x, x, attn_mask=causal, need_weights=False)
    sample = recording.samples()[0]
    assert sample.causal
    heads = sample.probs.shape[1]
    result = attention_metrics(sample.probs, attendable=sample.attendable.expand(-1, heads, -1, -1))
    _, weights = attention(x, x, x, attn_mask=causal, average_attn_weights=False)
    expected = [attention_reference(w, causal=True)["entropy"] for w in weights.detach().double().numpy()[0]]
    assert result["entropy"][0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.isnan(result["eigen_gap"]).all()


class _Reads(nn.Module):
    """Records the real tokens the tracker gives for 3 tokens inside its forward, then calls ``inner``."""

    def __init__(self, masks: ForwardTokenMasks, seen: list, inner: nn.Module | None = None, **inner_kwargs):
        super().__init__()
        self.masks, self.seen, self.inner, self.inner_kwargs = masks, seen, inner, inner_kwargs

    def forward(self, x, **kwargs):
        tokens = self.masks.real_tokens(3, 1)
        self.seen.append(None if tokens is None else tokens.tolist())
        if self.inner is not None:
            self.inner(x, **self.inner_kwargs)
        return x


def test_padded_queries_come_from_the_innermost_module_that_says():
    seen: list = []
    masks = ForwardTokenMasks(fallback=torch.tensor([[True, False, True]]))
    decoder = _Reads(masks, seen)
    expanded = _Reads(masks, seen, decoder, attention_mask=None)  # a decoder without decoder_attention_mask
    model = _Reads(masks, seen, expanded, attention_mask=torch.zeros(1, 1, 3, 3))  # 4-D: says nothing
    masks.install(model)
    try:
        model(torch.zeros(1), attention_mask=torch.tensor([[1, 1, 0]]))
        model(torch.zeros(1), src_key_padding_mask=torch.tensor([[False, True, True]]))
        model(torch.zeros(1))
    finally:
        masks.remove()
    hugging_face = [[[True, True, False]], [[True, True, False]], None]
    pytorch = [[[True, False, False]], [[True, False, False]], None]
    fallback = [[[True, False, True]], [[True, False, True]], None]
    assert seen == hugging_face + pytorch + fallback


def test_a_token_mask_of_another_batch_is_refused_naming_token_mask():
    masks = ForwardTokenMasks(fallback=torch.ones(3, 16, dtype=torch.bool))
    assert masks.real_tokens(16, 3) is masks.fallback
    assert masks.real_tokens(8, 4) is None  # other tokens: not this computation's mask
    with pytest.raises(
        ValueError, match=r"3 sequences of 16 tokens for a forward of 4 sequences: token_mask"
    ):
        masks.real_tokens(16, 4)


def test_token_mask_must_be_a_function_of_the_batch():
    with pytest.raises(ValueError, match="token_mask"):
        SpectralMonitor(token_mask=torch.ones(2, 3))


@pytest.mark.slow
def test_the_documented_extractor_example_runs(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing import event_accumulator

    from spectral_monitor.probes import attention as attention_probe

    page = (Path(__file__).resolve().parents[2] / "docs" / "extractors.md").read_text()
    example = page.split("A complete example:")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    registered = dict(attention_probe._GLOBAL_EXTRACTORS)
    namespace: dict = {}
    try:
        exec(compile(example, "docs/extractors.md", "exec"), namespace)  # fits on its padded batches
    finally:
        attention_probe._GLOBAL_EXTRACTORS.clear()
        attention_probe._GLOBAL_EXTRACTORS.update(registered)
    trainer = namespace["trainer"]
    events = event_accumulator.EventAccumulator(str(trainer.logger.log_dir), size_guidance={"scalars": 0})
    events.Reload()
    steps = [event.step for event in events.Scalars("attention/entropy/blocks.0.attention")]
    assert steps == [0, 4, 9]
    ranks = [event.value for event in events.Scalars("attention/effective_rank/blocks.1.attention")]
    assert all(0 < rank <= 6 for rank in ranks)


def test_an_extractor_may_say_which_queries_are_real():
    class ByHand(nn.Module):
        def forward(self, q, k):
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1)

    real = torch.tensor([[True, True, False, True]])

    def extractor(module, args, kwargs, output):
        q, k = args
        return AttentionInputs(q=q, k=k, query_mask=real)

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    capture = AttentionCapture(ByHand(), extractors={ByHand: extractor})
    with capture.armed() as recording:
        capture.model(q, k)
    assert torch.equal(recording.captured[0].query_mask, real)
    # Combined with the batch's token mask: a query is real only if both say so.
    with capture.armed(token_mask=torch.tensor([[True, False, True, True]])) as recording:
        capture.model(q, k)
    assert recording.captured[0].query_mask.tolist() == [[True, False, False, True]]
