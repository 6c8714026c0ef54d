"""Weight spectra (power-law α, MP density, energy rank), low-rank compression, head diversity, preflight,
and the callback writing them to TensorBoard."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import nn

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.metrics.heads import head_diversity, head_spectral_distances, most_redundant_head_pairs
from spectral_monitor.metrics.spectra import energy_rank, marchenko_pastur_density, power_law_alpha
from spectral_monitor.toolbox import weight_spectra as toolbox_weight_spectra
from spectral_monitor.toolbox.compression import low_rank_linear
from spectral_monitor.toolbox.preflight import architecture_preflight
from spectral_monitor.toolbox.weight_spectra import esd_figure, weight_spectra

pytestmark = pytest.mark.usefixtures("one_thread")


def pareto_with_a_bulk(alpha: float, seed: int = 0) -> np.ndarray:
    """1000 draws of p(x) ∝ x^{−α} on [1, ∞) over 300 uniform draws in [0.05, 0.95] (a bulk below xmin)."""
    rng = np.random.default_rng(seed)
    tail = (1 - rng.random(1000)) ** (-1 / (alpha - 1))
    return np.concatenate([tail, rng.uniform(0.05, 0.95, 300)])


@pytest.mark.parametrize("alpha", [2.5, 4.0])
def test_power_law_alpha_recovers_the_exponent_of_a_pareto_tail(alpha):
    fit = power_law_alpha(torch.from_numpy(pareto_with_a_bulk(alpha)))
    assert float(fit["alpha"]) == pytest.approx(alpha, rel=0.06)
    assert float(fit["xmin"]) >= 0.95  # the bulk below 1 is left out of the tail
    assert 0 < float(fit["ks_distance"]) < 0.05


@pytest.mark.parametrize("alpha", [2.5, 4.0])
def test_power_law_alpha_is_weightwatchers_fit(alpha):
    WWFit = pytest.importorskip("weightwatcher.WW_powerlaw").WWFit
    data = pareto_with_a_bulk(alpha, seed=1)
    ours = power_law_alpha(torch.from_numpy(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = WWFit(np.sort(data))
    assert float(ours["alpha"]) == pytest.approx(theirs.alpha, rel=1e-9)
    assert float(ours["xmin"]) == pytest.approx(theirs.xmin, rel=1e-12)
    assert float(ours["ks_distance"]) == pytest.approx(theirs.D, rel=1e-9)


def test_power_law_alpha_leaves_out_zero_eigenvalues_and_refuses_bad_input():
    values = torch.cat([torch.from_numpy(pareto_with_a_bulk(3.0)), torch.zeros(50, dtype=torch.float64)])
    assert float(power_law_alpha(values)["alpha"]) == float(power_law_alpha(values[values > 0])["alpha"])
    assert math.isnan(float(power_law_alpha(torch.ones(1, dtype=torch.float64))["alpha"]))
    with pytest.raises(ValueError, match="eigenvalues"):
        power_law_alpha(torch.ones(3, 3))
    with pytest.raises(ValueError, match=">= 0"):
        power_law_alpha(torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize(("rows", "cols"), [(400, 100), (100, 400), (200, 200)])
def test_marchenko_pastur_density_integrates_to_one_and_fits_an_iid_matrix(rows, cols):
    variance = 0.3
    lower = variance * (math.sqrt(rows) - math.sqrt(cols)) ** 2
    upper = variance * (math.sqrt(rows) + math.sqrt(cols)) ** 2
    grid = torch.linspace(lower, upper, 200_001, dtype=torch.float64)
    density = marchenko_pastur_density(grid, rows, cols, variance)
    if rows != cols:  # the square case has an integrable 1/√λ singularity at 0 the grid cannot resolve
        assert float(torch.trapezoid(density, grid)) == pytest.approx(1.0, abs=2e-3)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * math.sqrt(
        variance
    )
    eigenvalues = torch.linalg.svdvals(w).square()
    median = float(eigenvalues.median())
    below = grid <= median
    assert float(torch.trapezoid(density[below], grid[below])) == pytest.approx(0.5, abs=0.05)
    assert float(eigenvalues.max()) == pytest.approx(upper, rel=0.08)


def test_energy_rank_keeps_the_stated_share_of_the_squared_norm():
    sigma = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)  # energies 9, 4, 1 of 14
    assert int(energy_rank(sigma, 9 / 14)) == 1
    assert int(energy_rank(sigma, 0.9)) == 2  # 13/14 = 0.93
    assert int(energy_rank(sigma, 0.99)) == 3
    with pytest.raises(ValueError, match="level"):
        energy_rank(sigma, 0.0)


@pytest.mark.parametrize("rank", [1, 5, 12])
def test_low_rank_linear_error_is_the_discarded_singular_values(rank):
    torch.manual_seed(0)
    linear = nn.Linear(20, 12).double()
    original = linear.weight.detach().clone()
    factorised = low_rank_linear(linear, rank=rank)
    assert torch.equal(linear.weight, original)
    product = (factorised[1].weight @ factorised[0].weight).detach()
    sigma = torch.linalg.svdvals(original)
    error = original - product
    # Eckart–Young: ‖W − W_r‖_F² = Σ_{i>r} σᵢ², ‖W − W_r‖₂ = σ_{r+1}.
    assert float(error.square().sum()) == pytest.approx(float(sigma[rank:].square().sum()), abs=1e-10)
    expected_spectral = float(sigma[rank]) if rank < 12 else 0.0
    assert float(torch.linalg.matrix_norm(error, 2)) == pytest.approx(expected_spectral, abs=1e-10)
    x = torch.randn(3, 20, dtype=torch.float64)
    assert torch.allclose(factorised(x), x @ product.T + linear.bias, atol=1e-12)


def test_low_rank_linear_by_energy_and_its_errors():
    linear = nn.Linear(30, 30)
    generator_state = torch.random.get_rng_state()
    factorised = low_rank_linear(linear, energy=0.9)
    assert torch.equal(torch.random.get_rng_state(), generator_state)  # no global random numbers drawn
    sigma = torch.linalg.svdvals(linear.weight.detach().double())
    rank = factorised[0].out_features
    assert rank == int(energy_rank(sigma, 0.9))
    kept = float(sigma[:rank].square().sum() / sigma.square().sum())
    assert kept >= 0.9 > float(sigma[: rank - 1].square().sum() / sigma.square().sum())
    with pytest.raises(ValueError, match="exactly one"):
        low_rank_linear(linear)
    with pytest.raises(ValueError, match="rank must be"):
        low_rank_linear(linear, rank=31)
    with pytest.raises(ValueError, match=r"^energy must be a fraction in \(0, 1\], got 1.5$"):
        low_rank_linear(linear, energy=1.5)
    with pytest.raises(ValueError, match="nn.Linear"):
        low_rank_linear(nn.Conv1d(2, 2, 1), rank=1)


def test_head_distances_are_zero_for_equal_spectra_and_largest_for_rank_one_against_flat():
    n = 64
    rank_one = torch.zeros(n, dtype=torch.float64)
    rank_one[0] = 1.0
    flat = torch.ones(n, dtype=torch.float64)
    heads = torch.stack([rank_one, 2 * flat, flat, 3 * rank_one])  # scale does not matter
    distances = head_spectral_distances(heads)
    assert torch.allclose(distances, distances.T)
    assert float(distances[1, 2]) == pytest.approx(0.0, abs=1e-7)
    assert float(distances[0, 3]) == pytest.approx(0.0, abs=1e-7)
    # The definition written out in float64: √(½ KL(p‖m) + ½ KL(q‖m)) in bits, m the midpoint.
    p, q = rank_one / rank_one.sum(), flat / flat.sum()
    m = (p + q) / 2
    kl = lambda a, b: float((a[a > 0] * (a[a > 0] / b[a > 0]).log2()).sum())  # noqa: E731
    assert float(distances[0, 1]) == pytest.approx(math.sqrt((kl(p, m) + kl(q, m)) / 2), rel=1e-10)
    summary = head_diversity(distances)
    assert float(summary["head_diversity_min"]) == pytest.approx(0.0, abs=1e-7)
    assert float(summary["head_diversity"]) == pytest.approx(float(distances[0, 1]) * 4 / 6, rel=1e-6)
    pairs = most_redundant_head_pairs(distances, 2)
    assert {pair[:2] for pair in pairs} == {(0, 3), (1, 2)}


def test_preflight_warns_about_the_collapsing_config_and_not_its_log_n_twin():
    def logit_findings(**scaling):
        model = DemoTransformer(seq_len=512, n_layers=2, causal=False, **scaling)
        return [f for f in architecture_preflight(model, context_length=512) if f.check == "logit_scale"]

    collapsing = logit_findings()
    assert [f.severity for f in collapsing] == ["warning", "warning"]
    assert "nearly rank one" in collapsing[0].message
    assert [f.severity for f in logit_findings(logit_scaling="log_n", log_n_gamma=5.0)] == ["info", "info"]


def test_preflight_reads_structure_and_initialisation():
    deep_post_ln = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, batch_first=True), 6)
    findings = architecture_preflight(deep_post_ln)
    assert any(f.check == "depth" and f.severity == "warning" and "warm-up" in f.message for f in findings)
    assert {f.message.split(" (")[0] for f in findings if f.check == "head_dim"} == {"d_k = 8"}

    no_norm = nn.Sequential()
    no_norm.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2) for _ in range(3))
    for block in no_norm.blocks:
        block.norm1 = block.norm2 = nn.Identity()
    assert any(
        f.check == "depth" and "no normalisation" in f.message for f in architecture_preflight(no_norm)
    )

    low_rank = nn.Linear(64, 64)
    with torch.no_grad():
        low_rank.weight.copy_(torch.randn(64, 1) @ torch.randn(1, 64))
    (finding,) = [f for f in architecture_preflight(nn.Sequential(low_rank)) if f.check == "init_scale"]
    assert "not an iid draw" in finding.message
    iid = nn.Sequential(nn.Linear(64, 64))
    assert not [f for f in architecture_preflight(iid) if f.check == "init_scale"]
    with pytest.raises(ValueError, match="context_length"):
        architecture_preflight(iid, context_length=1)


class FusedQKVBlock(nn.Module):
    """Attention whose q, k and v come out of one projection, ``qkv``, in a layout no family names."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=2)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))


def test_a_fused_projection_no_layout_splits_is_a_preflight_finding_and_one_warning_in_a_run(tmp_path):
    from spectral_monitor import Monitor

    torch.manual_seed(0)
    model = nn.Sequential(FusedQKVBlock(), FusedQKVBlock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preflight files it, and says nothing
        findings = architecture_preflight(model)
    (finding,) = [finding for finding in findings if finding.check == "qkv_layout"]
    assert finding.severity == "info" and 'fuses q, k and v in "qkv"' in finding.message
    # In a run: the preflight, the weight probe and the weight spectra each read the weights; one warning.
    x = torch.randn(2, 8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = Monitor(model, logdir=str(tmp_path), every_n_steps=1, weight_spectra_every_n_logs=1)
        for step in range(2):
            with monitor.step(step, batch=x):
                model(x)
        monitor.close()
    assert sum('fuses q, k and v in "qkv"' in str(warning.message) for warning in caught) == 1


def test_weight_spectra_of_an_iid_layer_sit_at_the_marchenko_pastur_edge():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256))
    (spectrum,) = weight_spectra(model)
    assert spectrum.layer == "0" and (spectrum.rows, spectrum.cols) == (256, 128)
    assert spectrum.singular_values[0] == pytest.approx(spectrum.mp_edge, rel=0.05)
    assert spectrum.energy_rank_90 < spectrum.energy_rank_99 <= 128
    figure = esd_figure(spectrum)
    assert len(figure.axes[0].lines) >= 2  # the MP density and its edge


def test_the_esd_of_a_square_iid_weight_on_a_log_axis_is_per_decade_and_follows_its_law():
    # A square iid weight's smallest eigenvalues reach ~1e-7 of its largest: the axis is logarithmic, and
    # per unit λ the narrow bins down there would tower over the bulk while the law diverges at 0.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 384, bias=False))
    nn.init.normal_(model[0].weight, std=0.02)
    (spectrum,) = weight_spectra(model)
    axes = esd_figure(spectrum).axes[0]
    assert axes.get_xscale() == "log" and axes.get_ylabel() == "density per decade of λ"
    (histogram,) = axes.patches
    density, edges, _ = histogram.get_data()
    assert float(np.sum(density * np.diff(np.log10(edges)))) == pytest.approx(1.0)
    law = next(line for line in axes.lines if line.get_label().startswith("MP law"))
    law_density, decades = law.get_ydata(), np.log10(law.get_xdata())
    # The law per decade integrates to 1 over the eigenvalues' span, less what lies above the largest one.
    area = np.sum((law_density[1:] + law_density[:-1]) / 2 * np.diff(decades))
    assert float(area) == pytest.approx(1.0, abs=0.03)
    # The histogram follows the law where most eigenvalues are, and the axis is scaled to both.
    assert float(density.max()) == pytest.approx(float(np.nanmax(law_density)), rel=0.25)
    top = axes.get_ylim()[1]
    assert float(density.max()) <= top <= 2.5 * float(density.max())


def test_weight_spectra_match_float64_svd_and_reuse_spectra_given_to_them(monkeypatch):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(96, 192), nn.Linear(192, 40, bias=False))
    with torch.no_grad():
        model[0].weight[:, :4] *= 25  # spikes above the bulk, a heavier tail
        model[1].weight[:, 20:] = 0  # rank 20 of 40
    spectra = {spectrum.layer: spectrum for spectrum in weight_spectra(model)}
    for layer, module in (("0", model[0]), ("1", model[1])):
        exact = torch.linalg.svdvals(module.weight.detach().double())
        spectrum = spectra[layer]
        assert spectrum.singular_values.dtype == np.float64
        assert np.abs(spectrum.singular_values - exact.numpy()).max() <= 1e-7 * float(exact[0])
        fit = power_law_alpha(exact.square())
        assert spectrum.alpha == pytest.approx(float(fit["alpha"]), rel=1e-6)
        assert spectrum.energy_rank_99 == int(energy_rank(exact, 0.99))
    assert spectra["0"].mp_spikes == 4

    given = {"0": spectra["0"].singular_values}
    decomposed = []
    full_spectra = toolbox_weight_spectra.full_spectra
    monkeypatch.setattr(
        toolbox_weight_spectra,
        "full_spectra",
        lambda targets: decomposed.extend(targets) or full_spectra(targets),
    )
    again = weight_spectra(model, singular_values=given)
    assert [target.key for target in decomposed] == ["1"]
    assert np.shares_memory(again[0].singular_values, given["0"]) and again[0].alpha == spectra["0"].alpha


def test_a_zero_initialised_weight_is_drawn_without_a_numerical_warning():
    model = nn.Sequential(nn.Linear(16, 16))
    nn.init.zeros_(model[0].weight)
    (spectrum,) = weight_spectra(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = esd_figure(spectrum)
        figure.canvas.draw()
    (histogram,) = figure.axes[0].patches
    density, edges, _ = histogram.get_data()
    assert float(np.sum(density * np.diff(edges))) == pytest.approx(1.0)  # every λ at 0


@pytest.mark.slow
def test_callback_writes_head_diversity_weight_spectra_and_the_preflight(tmp_path):
    model = DemoTransformer(seq_len=32, n_layers=2, d_model=32, causal=False)
    data = SyntheticDataModule(seq_len=32, batch_size=4, num_batches=4, num_pairs=4, num_queries=2)
    monitor = SpectralMonitor(
        every_n_steps=2,
        families=["attention", "weights"],
        head_diversity_every_n_logs=1,
        weight_spectra_every_n_logs=2,
        figures_every_n_logs=0,
    )
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run", version=0)
    import pytorch_lightning as pl

    trainer = pl.Trainer(
        max_steps=4,
        logger=logger,
        callbacks=[monitor],
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=2,
    )
    with pytest.warns(RuntimeWarning, match="preflight \\(logit_scale"):
        trainer.fit(model, datamodule=data)
    everything = {kind: 0 for kind in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    events = event_accumulator.EventAccumulator(logger.log_dir, size_guidance=everything)
    events.Reload()
    scalars = set(events.Tags()["scalars"])

    logging_steps = [0, 1, 3]
    diversity = events.Scalars("attention/head_diversity/blocks.0.attention")
    assert [e.step for e in diversity] == logging_steps
    assert all(0 <= e.value < 1 for e in diversity)
    for metric in ("mp_edge", "mp_spikes", "alpha", "energy_rank_90", "energy_rank_99"):
        assert f"weights/{metric}/blocks.1.mlp.0" in scalars, metric
    assert [e.step for e in events.Scalars("weights/energy_rank_99/blocks.0.attention.q")] == [0, 3]
    texts = set(events.Tags()["tensors"])
    assert "preflight/text_summary" in texts
    assert "attention/redundant_heads/text_summary" in texts
    preflight = events.Tensors("preflight/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "logit_scale" in preflight and "blocks.0.attention" in preflight


def test_callback_refuses_bad_toolbox_arguments():
    with pytest.raises(ValueError, match="head_diversity_every_n_logs"):
        SpectralMonitor(head_diversity_every_n_logs=-1)
    with pytest.raises(ValueError, match="weight_spectra_every_n_logs"):
        SpectralMonitor(weight_spectra_every_n_logs=1.5)
    with pytest.raises(ValueError, match="preflight_context_length"):
        SpectralMonitor(preflight_context_length=1)
    with pytest.raises(ValueError, match="preflight"):
        SpectralMonitor(preflight="yes")
