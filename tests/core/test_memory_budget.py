"""``memory_budget_mb`` bounds the peak memory a logging step's attention work adds, figures included.

Measured as the growth of the resident set of a fresh process over ``on_train_batch_end`` (the metrics, head
diversity, figures and writing of a logging step), at n = 2048 where one attention matrix is 16 MiB in
float32 (how: ``tests/helpers/resident_set.py``).
"""

from pathlib import Path

import pytest
from helpers.resident_set import needs_resident_set_counters, run_probe

ALLOWANCE_MIB = 32
"""What a logging step adds besides the attention work the budget covers: the figures' canvases (made on
the first figure step and kept), PNG encoding, histograms, the records and the interpreter's own
allocations. Measured with this probe at n = 128, where the attention's share is under 1 MiB: 26.3–26.7 MiB
on the first logging step, which makes the figures, and 8.6–8.9 MiB on later ones (3 runs, 2-core VM)."""

STEP_PROBE = """
    import math
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset
    from spectral_monitor import SpectralMonitor
    from spectral_monitor.demo import DemoTransformer

    logdir, n, budget_mb, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    map_large_buffers_alone()
    peaks = []
    step_end = SpectralMonitor.on_train_batch_end

    def measured(self, *args):
        baseline = reset_peak()
        step_end(self, *args)
        peaks.append(status("VmHWM") - baseline)

    SpectralMonitor.on_train_batch_end = measured
    model = DemoTransformer(vocab_size=16, d_model=32, n_layers=2, n_heads=2, seq_len=n, causal=False,
                            init_std=0.3)
    tokens = torch.randint(16, (2, n), generator=torch.Generator().manual_seed(0))
    monitor = SpectralMonitor(every_n_steps=1, families=("attention",), max_sequences=2,
                              memory_budget_mb=budget_mb, figures_every_n_logs=1,
                              head_diversity_every_n_logs=1, attention_rank_sums=False, strict=True,
                              preflight=False, attention_cost_ratio=math.inf)
    trainer = pl.Trainer(max_steps=steps, logger=TensorBoardLogger(logdir, name="run", version=0),
                         callbacks=[monitor], accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=2))
    print(json.dumps({"peaks": peaks}))
"""


@pytest.mark.slow
@needs_resident_set_counters
@pytest.mark.parametrize(("budget_mb", "steps"), [(64.0, 2), (256.0, 1)])
def test_a_logging_step_at_2048_tokens_keeps_the_memory_budget_figures_included(
    tmp_path: Path, budget_mb: float, steps: int
) -> None:
    """Two layers × two sequences × two heads of 2048² attention are 128 MiB in float32, the metrics' exact
    working memory about seven times that, and a float64 copy of one matrix 32 MiB: a 64 MB budget holds
    none of it whole. Figures and head diversity on every logging step (one step at 256 MB, where head
    diversity factorises eight float64 matrices, to keep the test short)."""
    from tensorboard.backend.event_processing import event_accumulator

    n = 2048
    peaks = run_probe(STEP_PROBE, tmp_path, n, budget_mb, steps)["peaks"]
    print(f"peak growth per logging step at {budget_mb:g} MB: {[round(p / 2**20, 1) for p in peaks]} MiB")
    assert len(peaks) == steps
    for peak in peaks:
        assert 0 < peak <= (budget_mb + ALLOWANCE_MIB) * 2**20, f"peak {peak / 2**20:.1f} MiB"

    events = event_accumulator.EventAccumulator(
        str(tmp_path / "run" / "version_0"), size_guidance={"images": 0, "scalars": 0}
    )
    events.Reload()
    images = set(events.Tags()["images"])
    assert {"attention/figures/spectrum", "attention/figures/heatmap/blocks.0.attention"} <= images
    assert len(events.Images("attention/figures/spectrum")) == steps
    for layer in ("blocks.0.attention", "blocks.1.attention"):
        entropy = events.Scalars(f"attention/entropy/{layer}")
        assert len(entropy) == steps and all(0 < event.value < 1 for event in entropy)


@pytest.mark.parametrize("matrices_per_chunk", [1, 3, 4, 6])
def test_measuring_a_chunk_of_matrices_at_a_time_gives_what_one_call_gives(matrices_per_chunk: int) -> None:
    """Chunks of one matrix, of heads of one sequence, of whole sequences: the exact metrics, the spectra
    head diversity uses and the drawn head's heatmap blocks are those of the whole layer in one call."""
    import torch

    from spectral_monitor import MonitorOptions
    from spectral_monitor.core.attention_plan import AttentionPlan
    from spectral_monitor.core.reports import Reports
    from spectral_monitor.demo import DemoTransformer
    from spectral_monitor.probes import AttentionCapture
    from spectral_monitor.probes.attention_records import DENSE_CALL_NBYTES
    from spectral_monitor.sinks.figures import attention_block_means
    from spectral_monitor.toolbox.head_diversity import attention_spectra, spectrum_working_nbytes

    model = DemoTransformer(vocab_size=16, d_model=32, n_layers=2, n_heads=4, seq_len=40, causal=True)
    tokens = torch.randint(16, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), AttentionCapture(model, max_sequences=3).armed() as recording:
        model(tokens)
    layers = recording.captured
    # Room for the chunk, its working memory and one float64 spectrum; chunks are sized keeping room for a
    # float32 one.
    per_matrix = layers[0].dense_matrix_nbytes(exact=True)
    spectrum = spectrum_working_nbytes(40, 40, torch.float64)
    room = DENSE_CALL_NBYTES + matrices_per_chunk * per_matrix + per_matrix // 2 + spectrum
    spectra_room = spectrum_working_nbytes(40, 40, torch.float32)
    assert layers[0].matrices_per_chunk(room - spectra_room, exact=True) == matrices_per_chunk

    plan = AttentionPlan(MonitorOptions.from_keywords(metric_method="exact"), Reports(strict=True))
    chunked = plan.measure(layers, room, diversity=True, draw=True)
    whole = plan.measure(layers, 2**30, diversity=True, draw=True)
    for captured, by_chunks, at_once in zip(layers, chunked, whole, strict=True):
        assert by_chunks.metrics.keys() == at_once.metrics.keys()
        for name, values in at_once.metrics.items():
            assert values.shape == (3, 4)
            torch.testing.assert_close(by_chunks.metrics[name], values, rtol=1e-6, atol=1e-7, equal_nan=True)
        sample = captured.sample()
        reference = attention_spectra(sample.probs, sample.query_mask, sample.key_mask)
        # The exact path's own singular values (float32, from the float64 Gram): within 1e-7 of svdvals.
        torch.testing.assert_close(by_chunks.spectra, reference, rtol=0, atol=1e-7)
        torch.testing.assert_close(by_chunks.spectra, at_once.spectra, rtol=0, atol=1e-7)
        blocks = attention_block_means(sample.probs[0, 0].numpy())
        assert by_chunks.drawn is not None
        assert by_chunks.drawn.blocks.shape == blocks.shape
        assert (by_chunks.drawn.blocks.means == blocks.means).all()
