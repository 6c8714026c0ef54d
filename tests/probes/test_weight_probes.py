"""The weight probe: warm-started spectral norms against float64 SVD, attention weights split as the models
use them, per-head ‖W_Q^hᵀ W_K^h‖₂ against the dense product, and a probe that observes without perturbing.

Matrices with both sides above 32 take the warm Lanczos path; smaller ones (most heads here) the exact one.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.hf_models import tiny_gpt2, tiny_llama
from helpers.reference_metrics import attention_probabilities
from torch import nn

from spectral_monitor.linalg import top_singular
from spectral_monitor.probes import weight_norms
from spectral_monitor.probes.weights import AttentionWeights, WeightProbe, query_key_spectral_norms

RTOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")


def reference_singular_values(matrix: torch.Tensor) -> np.ndarray:
    return np.linalg.svd(matrix.detach().double().numpy(), compute_uv=False)


def by_tag(measurements) -> dict[str, float]:
    return {record.tag: record.value for record in measurements}


def clustered_spectrum_weight(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """σ spread evenly over [0.5, 1]: neighbours 1% apart, slow for a cold Krylov start."""
    left, _ = torch.linalg.qr(torch.randn(rows, cols, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=torch.float64))
    return ((left * torch.linspace(1.0, 0.5, cols, dtype=torch.float64)) @ right.T).float()


def perturb_(model: nn.Module, scale: float, generator: torch.Generator) -> None:
    """A small 'training step': every parameter moves by ``scale`` relative noise."""
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(scale * parameter.norm() / math.sqrt(parameter.numel()) * noise)


# --------------------------------------------------------------------------------------------------------
# Spectral norms, warm state
# --------------------------------------------------------------------------------------------------------


def test_spectral_norms_track_float64_svd_over_warm_logging_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 7))
    generator = torch.Generator().manual_seed(1)
    probe = WeightProbe(model, iterations_per_step=2)
    for step in range(4):
        records = by_tag(probe.measure(step))
        for index, layer in enumerate(model):
            sigma = reference_singular_values(layer.weight)
            name = str(index)
            estimate = records[f"weights/spectral_norm/{name}"]
            residual = records[f"weights/spectral_norm_residual/{name}"]
            assert estimate == pytest.approx(sigma[0], rel=RTOL)
            assert abs(estimate - sigma[0]) / sigma[0] <= residual + 1e-6  # the residual bounds the error
            energy = np.sum(sigma**2)
            assert records[f"weights/frobenius_norm/{name}"] == pytest.approx(np.sqrt(energy), rel=1e-5)
            stable_rank = energy / sigma[0] ** 2
            assert records[f"weights/stable_rank/{name}"] == pytest.approx(stable_rank, rel=2 * RTOL)
        perturb_(model, 0.05, generator)


def test_conv1d_weights_stored_transposed_track_float64_over_warm_logging_steps() -> None:
    """Hugging Face GPT-2 keeps (in, out) weights: the probe measures them as they lie in memory, its square
    c_proj included. The cold first step is certified or exact (the dense route); the warm ones (σ₂/σ₁ ≈ 0.98
    in a fresh GPT-2, so two iterations do not resolve σ₁) stay below σ₁ and within their residual of it."""
    model = tiny_gpt2(seed=3, n_layer=1, n_embd=64, n_positions=16, vocab_size=40)
    generator = torch.Generator().manual_seed(4)
    probe = WeightProbe(model, iterations_per_step=2)
    matrices = dict(probe.named_matrices())
    assert {"h.0.attn.q", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"} <= set(matrices)
    assert not matrices["h.0.attn.c_proj"].is_contiguous()  # a transposed view of the stored (in, out)
    for step in range(4):
        records = by_tag(probe.measure(step))
        for name, matrix in matrices.items():
            sigma = reference_singular_values(matrix)[0]
            estimate = records[f"weights/spectral_norm/{name}"]
            residual = records[f"weights/spectral_norm_residual/{name}"]
            if step == 0:
                assert estimate == pytest.approx(sigma, rel=RTOL)
            assert estimate <= sigma * (1 + 1e-6)
            assert (sigma - estimate) / sigma <= residual + 1e-6
        perturb_(model, 0.05, generator)
    histograms = probe.distributions(4, singular_values=probe.singular_values())
    spectra = {record.layer: record.values for record in histograms if record.name == "singular_values"}
    for name, matrix in matrices.items():
        sigma = reference_singular_values(matrix)
        assert np.abs(spectra[name] - sigma).max() <= 2e-7 * sigma[0]


def test_weights_of_several_shapes_with_one_smaller_side_share_one_lanczos_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    # Gram side 40 for all three: a tall 96×40 (WᵀW), a wide 40×96 (WWᵀ) and a square 40×40.
    model = nn.Sequential(nn.Linear(40, 96), nn.Linear(96, 40), nn.Linear(40, 40))
    runs = []
    original = weight_norms.lanczos_eigsh
    monkeypatch.setattr(
        weight_norms, "lanczos_eigsh", lambda op, *a, **k: runs.append(op.batch) or original(op, *a, **k)
    )
    probe = WeightProbe(model, iterations_per_step=2)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        runs.clear()
        records = by_tag(probe.measure(step))
        assert runs == [3]  # cold at step 0, warm after: one run over the three weights each time
        for index, layer in enumerate(model):
            sigma = reference_singular_values(layer.weight)[0]
            estimate = records[f"weights/spectral_norm/{index}"]
            assert estimate == pytest.approx(sigma, rel=RTOL)
            assert abs(estimate - sigma) / sigma <= records[f"weights/spectral_norm_residual/{index}"] + 1e-6
        perturb_(model, 0.01, generator)


def test_warm_state_converges_within_two_iterations_where_a_cold_start_cannot() -> None:
    generator = torch.Generator().manual_seed(2)
    layer = nn.Linear(48, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(clustered_spectrum_weight(64, 48, generator))
    probe = WeightProbe(layer, iterations_per_step=2, tol=1e-3)
    probe.measure(0)
    perturb_(layer, 1e-3, generator)

    records = by_tag(probe.measure(1))
    assert records["weights/spectral_norm_residual/model"] <= 1e-3  # met tol within the 2-iteration budget
    assert records["weights/spectral_norm/model"] == pytest.approx(
        reference_singular_values(layer.weight)[0], rel=1e-4
    )
    cold = top_singular(
        layer.weight.detach()[None], tol=1e-3, max_iters=2, generator=torch.Generator().manual_seed(0)
    )
    assert float(cold.info.residual[0, 0]) > 10 * 1e-3


def test_a_cold_start_that_does_not_certify_within_its_trial_takes_the_exact_top_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh layer's top singular values crowd at the edge of a random bulk: the cold Lanczos trial cannot
    certify σ₁ there and the Gram matrix's dense top eigenpair is taken, exact, its vector the warm start;
    a weight whose σ₁ stands well clear of the rest certifies within the trial and is not decomposed."""
    generator = torch.Generator().manual_seed(4)
    crowded = nn.Linear(80, 96, bias=False)  # σ spread evenly over [0.5, 1]: neighbours 0.6% apart
    spiked = nn.Linear(80, 96, bias=False)
    with torch.no_grad():
        crowded.weight.copy_(clustered_spectrum_weight(96, 80, generator))
        bulk = clustered_spectrum_weight(96, 80, generator).double()
        u, _, vh = torch.linalg.svd(bulk)
        spiked.weight.copy_((bulk + 4.0 * u[:, :1] @ vh[:1]).float())
    decomposed = []
    dense_route = weight_norms._top_singular_pairs
    monkeypatch.setattr(
        weight_norms, "_top_singular_pairs", lambda m: decomposed.append(m.shape[0]) or dense_route(m)
    )
    probe = WeightProbe(
        nn.ModuleDict({"crowded": crowded, "spiked": spiked}), iterations_per_step=2, tol=1e-3
    )
    records = by_tag(probe.measure(0))
    assert decomposed == [1]  # the crowded one alone
    crowded_sigma = reference_singular_values(crowded.weight)[0]
    assert records["weights/spectral_norm/crowded"] == pytest.approx(crowded_sigma, rel=1e-6)
    assert records["weights/spectral_norm_residual/crowded"] == 0.0
    assert records["weights/spectral_norm/spiked"] == pytest.approx(
        reference_singular_values(spiked.weight)[0], rel=1e-3
    )
    assert records["weights/spectral_norm_residual/spiked"] > 0.0  # certified by Lanczos, not decomposed
    # The exact top vector is a warm start as good as a converged one: after a small step, two iterations
    # are within tol again, with nothing decomposed.
    perturb_(crowded, 1e-3, generator)
    records = by_tag(probe.measure(1))
    assert decomposed == [1]
    assert records["weights/spectral_norm_residual/crowded"] <= 1e-3
    assert records["weights/spectral_norm/crowded"] == pytest.approx(
        reference_singular_values(crowded.weight)[0], rel=1e-4
    )


def test_state_dict_round_trip_gives_identical_next_estimates() -> None:
    torch.manual_seed(3)
    model = nn.TransformerEncoderLayer(48, 2, 64, batch_first=True)
    running = WeightProbe(model, iterations_per_step=1)
    running.measure(0)
    buffer = io.BytesIO()
    torch.save(running.state_dict(), buffer)
    perturb_(model, 0.01, torch.Generator().manual_seed(4))

    resumed = WeightProbe(model, iterations_per_step=1)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    cold = WeightProbe(model, iterations_per_step=1)
    expected = running.measure(1)
    assert resumed.measure(1) == expected
    assert cold.measure(1) != expected  # so the equality above is the warm state's doing


def test_load_state_dict_tolerates_missing_and_extra_weights() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(40, 48), nn.Linear(48, 36))
    probe = WeightProbe(model)
    probe.measure(0)
    state = probe.state_dict()
    del state["right_vectors"]["1"]
    state["right_vectors"]["gone.layer"] = torch.ones(4, 1)
    del state["generator"]

    restored = WeightProbe(model)
    restored.load_state_dict(state)
    records = by_tag(restored.measure(1))
    assert records["weights/spectral_norm/1"] == pytest.approx(
        reference_singular_values(model[1].weight)[0], rel=RTOL
    )
    assert set(restored.state_dict()["right_vectors"]) == {"0", "1"}


def test_a_weight_that_changes_shape_or_disappears_restarts_cold_without_error() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 40))
    probe = WeightProbe(model, iterations_per_step=1)
    probe.measure(0)
    model[0] = nn.Linear(36, 48)  # same name, new shape: the stored vector no longer fits
    del model[2]

    records = by_tag(probe.measure(1))
    assert records["weights/spectral_norm/0"] == pytest.approx(
        reference_singular_values(model[0].weight)[0], rel=RTOL
    )
    assert "weights/spectral_norm/2" not in records
    assert set(probe.state_dict()["right_vectors"]) == {"0"}


def test_a_zero_weight_has_zero_norms_and_an_undefined_stable_rank() -> None:
    model = nn.Sequential(nn.Linear(40, 36), nn.Linear(5, 4))  # the iterative and the exact path
    with torch.no_grad():
        for layer in model:
            layer.weight.zero_()
    records = by_tag(WeightProbe(model).measure(0))
    for name in ("0", "1"):
        assert records[f"weights/spectral_norm/{name}"] == 0.0
        assert records[f"weights/frobenius_norm/{name}"] == 0.0
        assert math.isnan(records[f"weights/stable_rank/{name}"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_weights_get_nan_norms_and_their_finite_neighbours_their_own(dtype: torch.dtype) -> None:
    model = nn.Sequential(*(nn.Linear(40, 36) for _ in range(4)), nn.Linear(5, 4), nn.Linear(5, 4)).to(dtype)
    with torch.no_grad():
        model[1].weight[3, 7] = math.nan
        model[2].weight[0, 0] = math.inf
        model[4].weight[1, 2] = -math.inf
    records = by_tag(WeightProbe(model).measure(0))
    for name in ("1", "2", "4"):
        assert math.isnan(records[f"weights/spectral_norm/{name}"])
    for name in ("0", "3", "5"):
        expected = reference_singular_values(model[int(name)].weight)[0]
        assert records[f"weights/spectral_norm/{name}"] == pytest.approx(expected, rel=RTOL)


# --------------------------------------------------------------------------------------------------------
# Attention weights, split as the models use them
# --------------------------------------------------------------------------------------------------------


def test_multihead_attention_packed_split_is_exactly_the_in_proj_slices_the_module_uses() -> None:
    torch.manual_seed(7)
    attention = nn.MultiheadAttention(12, 3, batch_first=True)
    probe = WeightProbe(attention)
    matrices = dict(probe.named_matrices())
    packed = attention.in_proj_weight
    for index, role in enumerate("qkv"):
        assert torch.equal(matrices[role], packed[12 * index : 12 * (index + 1)])
    assert set(matrices) == {"q", "k", "v", "out_proj"}  # out_proj counted once

    x = torch.randn(2, 5, 12)
    _, weights = attention(x, x, x, need_weights=True, average_attn_weights=False)
    bias = attention.in_proj_bias
    query, key = matrices["q"], matrices["k"]
    expected = attention_probabilities(x, x, query, key, bias[:12], bias[12:24], 3)
    torch.testing.assert_close(weights, expected)

    records = by_tag(probe.measure(0))
    for head in range(3):
        rows = packed[12 + 4 * head : 12 + 4 * (head + 1)]  # head `head` of W_K
        assert records[f"weights/spectral_norm/k/head_{head}"] == pytest.approx(
            reference_singular_values(rows)[0], rel=RTOL
        )


def test_multihead_attention_with_kdim_and_vdim_reads_the_separate_projections() -> None:
    torch.manual_seed(8)
    attention = nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True)
    probe = WeightProbe(attention)
    matrices = dict(probe.named_matrices())
    assert matrices["q"] is not None and torch.equal(matrices["q"], attention.q_proj_weight)
    assert torch.equal(matrices["k"], attention.k_proj_weight)
    assert torch.equal(matrices["v"], attention.v_proj_weight)

    query, key = torch.randn(2, 4, 8), torch.randn(2, 6, 5)
    _, weights = attention(query, key, torch.randn(2, 6, 3), need_weights=True, average_attn_weights=False)
    bias = attention.in_proj_bias
    expected = attention_probabilities(query, key, matrices["q"], matrices["k"], bias[:8], bias[8:16], 2)
    torch.testing.assert_close(weights, expected)

    records = by_tag(probe.measure(0))
    for head in range(2):
        rows = slice(4 * head, 4 * (head + 1))
        bilinear = attention.q_proj_weight[rows].T @ attention.k_proj_weight[rows]  # 8 × 5
        assert records[f"weights/qk_spectral_norm/model/head_{head}"] == pytest.approx(
            reference_singular_values(bilinear)[0], rel=1e-5
        )
        assert records[f"weights/spectral_norm/v/head_{head}"] == pytest.approx(
            reference_singular_values(attention.v_proj_weight[rows])[0], rel=RTOL
        )


def test_gpt2_c_attn_splits_into_the_query_key_value_the_model_computes() -> None:
    model = tiny_gpt2(attention="eager", seed=9, n_embd=16, n_positions=16, vocab_size=40).eval()
    seen = {}
    model.h[1].attn.c_attn.register_forward_hook(lambda _, args, output: seen.update(x=args[0], qkv=output))
    with torch.no_grad():
        attentions = model(torch.randint(0, 40, (2, 6)), output_attentions=True).attentions

    matrices = dict(WeightProbe(model).named_matrices())
    assert "h.1.attn.c_attn" not in matrices and "h.1.attn.c_proj" in matrices and "h.1.mlp.c_fc" in matrices
    bias = model.h[1].attn.c_attn.bias
    for role, computed, role_bias in zip("qkv", seen["qkv"].split(16, dim=2), bias.split(16), strict=True):
        torch.testing.assert_close(seen["x"] @ matrices[f"h.1.attn.{role}"].T + role_bias, computed)
    expected = attention_probabilities(
        seen["x"],
        seen["x"],
        matrices["h.1.attn.q"],
        matrices["h.1.attn.k"],
        bias[:16],
        bias[16:32],
        4,
        causal=True,
    )
    torch.testing.assert_close(attentions[1], expected)  # the same heads, in the same order

    c_proj = model.h[1].attn.c_proj.weight  # Conv1D stores (in, out)
    torch.testing.assert_close(matrices["h.1.attn.c_proj"], c_proj.T)


def test_per_head_query_key_norm_matches_the_dense_bilinear_form() -> None:
    torch.manual_seed(10)
    attention = nn.MultiheadAttention(16, 4)
    records = by_tag(WeightProbe(attention).measure(0))
    query, key, _ = attention.in_proj_weight.detach().chunk(3)
    heads = zip(query.chunk(4), key.chunk(4), strict=True)
    dense = [reference_singular_values(q_h.T @ k_h)[0] for q_h, k_h in heads]
    measured = [records[f"weights/qk_spectral_norm/model/head_{h}"] for h in range(4)]
    np.testing.assert_allclose(measured, dense, rtol=1e-5)
    assert records["weights/qk_spectral_norm_max/model"] == pytest.approx(max(dense), rel=1e-5)


def test_grouped_query_heads_pair_each_query_head_with_its_key_head() -> None:
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(4 * 3, 10, generator=generator, dtype=torch.float64)  # 4 query heads, d_k = 3
    key = torch.randn(2 * 3, 7, generator=generator, dtype=torch.float64)  # 2 key heads
    norms = query_key_spectral_norms(query, key, num_heads=4, num_key_value_heads=2)
    dense = [
        reference_singular_values(query[3 * h : 3 * h + 3].T @ key[3 * (h // 2) : 3 * (h // 2) + 3])[0]
        for h in range(4)
    ]
    np.testing.assert_allclose(norms.numpy(), dense, rtol=1e-12)


def test_query_heads_of_deficient_rank_take_the_factored_route_to_the_same_norm() -> None:
    """A zero query head and one whose rows repeat have no Cholesky factor of their Gram matrix: their norms
    come from QR factors, the others' from the Gram matrices, each within float32 rounding of float64."""
    generator = torch.Generator().manual_seed(13)
    query = torch.randn(4 * 3, 10, generator=generator)
    query[0:3] = 0.0
    query[3:6] = query[3].repeat(3, 1)
    query[6:9] *= 1e-3  # small but of full rank: the Gram route
    key = torch.randn(4 * 3, 7, generator=generator)
    norms = query_key_spectral_norms(query, key, num_heads=4)
    dense = [
        reference_singular_values(query[3 * h : 3 * h + 3].double().T @ key[3 * h : 3 * h + 3].double())[0]
        for h in range(4)
    ]
    assert norms[0].item() == 0.0
    np.testing.assert_allclose(norms[1:].numpy(), dense[1:], rtol=1e-6)


def test_llama_separate_projections_with_grouped_keys_are_read_per_head() -> None:
    model = tiny_llama(
        seed=12,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=30,
        pad_token_id=None,
    )
    attention = model.layers[0].self_attn
    records = by_tag(WeightProbe(attention).measure(0))
    query, key = attention.q_proj.weight, attention.k_proj.weight
    for head in range(4):
        bilinear = query[4 * head : 4 * head + 4].T @ key[4 * (head // 2) : 4 * (head // 2) + 4]
        assert records[f"weights/qk_spectral_norm/model/head_{head}"] == pytest.approx(
            reference_singular_values(bilinear)[0], rel=1e-5
        )
    assert "weights/spectral_norm/k/head_1" in records
    assert "weights/spectral_norm/k/head_2" not in records  # two key heads only
    assert "weights/spectral_norm/o_proj" in records
    assert "weights/spectral_norm/q_proj" not in records  # reported as q


class NanoGPTAttention(nn.Module):
    """nanoGPT's layout: one packed ``c_attn`` Linear with rows [W_Q; W_K; W_V] and ``n_head``."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            part.unflatten(2, (self.n_head, -1)).transpose(1, 2) for part in self.c_attn(x).chunk(3, 2)
        )
        return self.c_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


def test_packed_linear_attention_split_reproduces_the_module_output() -> None:
    torch.manual_seed(13)
    attention = NanoGPTAttention(12, 3)
    matrices = dict(WeightProbe(attention).named_matrices())
    assert set(matrices) == {"q", "k", "v", "c_proj"}
    x = torch.randn(2, 5, 12)
    b_q, b_k, b_v = attention.c_attn.bias.chunk(3)
    probs = attention_probabilities(x, x, matrices["q"], matrices["k"], b_q, b_k, 3)
    values = (x @ matrices["v"].T + b_v).unflatten(-1, (3, -1)).transpose(1, 2)
    expected = attention.c_proj((probs @ values).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x), expected)


def test_a_registered_reader_declares_an_attention_layout() -> None:
    class HandWritten(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk = nn.Linear(8, 8), nn.Linear(8, 8)

    torch.manual_seed(14)
    model = nn.Sequential(HandWritten())

    def read(module: nn.Module) -> AttentionWeights:
        return AttentionWeights(
            module.wq.weight.detach(), module.wk.weight.detach(), None, num_heads=2, replaces=("wq", "wk")
        )

    records = by_tag(WeightProbe(model, attention_readers={HandWritten: read}).measure(0))
    expected = {"weights/spectral_norm/0.q", "weights/spectral_norm/0.k", "weights/qk_spectral_norm/0/head_1"}
    assert expected <= set(records)
    assert "weights/spectral_norm/0.wq" not in records and "weights/spectral_norm/0.v" not in records


# --------------------------------------------------------------------------------------------------------
# Selection, histograms, observing only, bad input
# --------------------------------------------------------------------------------------------------------


def test_include_and_exclude_select_by_module_name_and_report_patterns_that_match_nothing() -> None:
    torch.manual_seed(15)
    layer = nn.TransformerEncoderLayer(8, 2, 16)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    probe = WeightProbe(
        model, include=["layers.*"], exclude=["layers.1.*", "*.self_attn", "no.such.*"], per_head=False
    )
    layers = {record.layer for record in probe.measure(0)}
    assert layers == {"layers.0.linear1", "layers.0.linear2", "layers.0.self_attn.out_proj"}
    assert probe.unmatched_patterns == ["no.such.*"]


def test_weights_split_into_memory_bounded_batches_are_all_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(18)
    model = nn.Sequential(*(nn.Linear(40, 40) for _ in range(5)))
    monkeypatch.setattr(weight_norms, "_MAX_BATCH_BYTES", 2 * 40 * 40 * 4)  # two weights per batch
    records = by_tag(WeightProbe(model).measure(0))
    for index, layer in enumerate(model):
        assert records[f"weights/spectral_norm/{index}"] == pytest.approx(
            reference_singular_values(layer.weight)[0], rel=RTOL
        )


def test_tied_weights_are_measured_once() -> None:
    first = nn.Linear(6, 6)
    second = nn.Linear(6, 6)
    second.weight = first.weight
    layers = {record.layer for record in WeightProbe(nn.Sequential(first, second)).measure(0)}
    assert layers == {"0"}


def test_distributions_hold_the_per_head_values_and_on_request_the_exact_spectrum() -> None:
    torch.manual_seed(16)
    model = nn.Sequential(nn.MultiheadAttention(12, 3), nn.Linear(12, 5))
    probe = WeightProbe(model)
    records = by_tag(probe.measure(4))
    records_of_step = probe.distributions(4, singular_values=probe.singular_values())
    histograms = {record.tag: record for record in records_of_step}

    per_head = histograms["weights/spectral_norm_per_head/0.q"].values
    np.testing.assert_array_equal(
        per_head, [records[f"weights/spectral_norm/0.q/head_{h}"] for h in range(3)]
    )
    qk = histograms["weights/qk_spectral_norm_per_head/0"].values
    np.testing.assert_array_equal(qk, [records[f"weights/qk_spectral_norm/0/head_{h}"] for h in range(3)])
    spectrum = histograms["weights/singular_values/1"].values
    np.testing.assert_allclose(spectrum, reference_singular_values(model[1].weight), rtol=1e-5)
    assert {"weights/singular_values/0.q", "weights/singular_values/0.out_proj"} <= set(histograms)
    assert all(record.step == 4 for record in histograms.values())
    assert not any("singular_values" in tag for tag in (r.tag for r in probe.distributions(4)))


def test_the_full_spectrum_of_a_large_weight_is_within_float32_rounding_of_sigma1_of_float64() -> None:
    torch.manual_seed(17)
    model = nn.Sequential(nn.Linear(384, 1536))
    with torch.no_grad():
        model[0].weight[:, :8] *= 30  # a few large singular values above a bulk, as training makes them
    probe = WeightProbe(model)
    records_of_step = probe.distributions(0, singular_values=probe.singular_values())
    histograms = {record.tag: record for record in records_of_step}
    spectrum = histograms["weights/singular_values/0"].values
    reference = reference_singular_values(model[0].weight)
    assert np.abs(spectrum - reference).max() <= 2e-7 * reference[0]


def test_measuring_leaves_parameters_grads_buffers_optimizer_and_global_rng_untouched() -> None:
    torch.manual_seed(17)
    model = nn.Sequential(
        nn.MultiheadAttention(8, 2, batch_first=True),
        nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),  # in training mode: power iteration on read
    )
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(3, 4, 8)
    model[1](model[0](x, x, x)[0]).sum().backward()
    optimizer.step()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    grads = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    optimizer_state = [{key: value.clone() for key, value in s.items()} for s in optimizer.state.values()]
    rng = torch.get_rng_state()

    probe = WeightProbe(model)
    probe.measure(0)
    probe.distributions(1, singular_values=probe.singular_values())

    assert torch.equal(torch.get_rng_state(), rng)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for name, parameter in model.named_parameters():
        assert parameter.grad is grads[name][0] and torch.equal(parameter.grad, grads[name][1]), name
    for state, saved in zip(optimizer.state.values(), optimizer_state, strict=True):
        assert all(torch.equal(state[key], value) for key, value in saved.items())


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"model": "not a module"}, "model"),
        ({"iterations_per_step": 0}, "iterations_per_step"),
        ({"iterations_per_step": 1.5}, "iterations_per_step"),
        ({"tol": 0.0}, "tol"),
        ({"tol": 2.0}, "tol"),
        ({"per_head": "yes"}, "per_head"),
        ({"include": "blocks.*"}, "include"),
        ({"exclude": []}, "exclude"),
        ({"attention_readers": {3: lambda module: None}}, "attention_readers"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_them(arguments: dict, named: str) -> None:
    model = arguments.pop("model", nn.Linear(3, 3))
    with pytest.raises(ValueError, match=named):
        WeightProbe(model, **arguments)


def test_inconsistent_attention_weights_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        AttentionWeights(torch.zeros(12, 4), torch.zeros(12, 4), None, num_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="d_k"):
        AttentionWeights(torch.zeros(12, 4), torch.zeros(8, 4), None, num_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="d_k"):
        query_key_spectral_norms(torch.zeros(12, 4), torch.zeros(8, 4), num_heads=4)
    probe = WeightProbe(nn.Sequential(nn.Linear(2, 2)), attention_readers={"0": lambda module: module.weight})
    with pytest.raises(ValueError, match="attention_readers"):
        probe.measure(0)
    dropped = WeightProbe(nn.Linear(2, 2)).load_state_dict({"right_vectors": {"model": "not a tensor"}})
    assert dropped == ["right_vectors.model (str 'not a tensor', not a floating-point tensor)"]


@pytest.mark.parametrize(
    ("dtype", "magnitude"), [(torch.float32, 2.0**126), (torch.float32, 2.0**-120), (torch.float64, 1e150)]
)
def test_query_key_norms_of_weights_whose_products_leave_their_dtypes_range_are_exact(
    dtype: torch.dtype, magnitude: float
) -> None:
    """float32 weights near either end of its range are measured in float64, where their products fit;
    float64 weights are scaled by a power of two first. Either way the norm is that of the unscaled heads."""
    generator = torch.Generator().manual_seed(17)
    query = torch.randn(2 * 3, 8, generator=generator, dtype=torch.float64)
    key = torch.randn(2 * 3, 8, generator=generator, dtype=torch.float64)
    weights = AttentionWeights((query * magnitude).to(dtype), (key * magnitude).to(dtype), None, num_heads=2)
    norms = weight_norms.attention_query_key_norms(weights)
    scaled = [
        reference_singular_values(query[3 * h : 3 * h + 3].T @ key[3 * h : 3 * h + 3])[0] * magnitude**2
        for h in range(2)
    ]
    np.testing.assert_allclose(norms, scaled, rtol=1e-6)
