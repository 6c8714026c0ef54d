"""``weight_spectra`` against WeightWatcher on the same model: power-law α, stable rank, spikes, and time.

The model is the demo transformer at a larger width, with a planted rank-4 signal (strength ``--signal`` times
the MP edge) added to every weight of the even blocks, so that some layers have spikes above the bulk and
heavy-ish tails. WeightWatcher runs with ``randomize=False`` (no randomised-ESD comparison) and
``mp_fit=True`` (its spike count needs its MP fit); both tools fit α on the eigenvalues σ² of every
``nn.Linear`` weight. Spikes differ by definition: ours count σ above σ̂(√N + √M) with σ̂² = ‖W‖_F²/(NM);
WeightWatcher's fit the bulk's σ to the ESD, so a strong signal (which inflates ‖W‖_F) is counted against
a lower edge there.

    pip install -e '.[bench]'
    python benchmarks/bench_weight_spectra.py --width 256 --layers 4
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings

import torch

from benchmarks._common import describe_machine, markdown_table
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.toolbox.weight_spectra import weight_spectra


def build_model(width: int, layers: int, signal: float, seed: int) -> DemoTransformer:
    model = DemoTransformer(d_model=width, n_layers=layers, n_heads=max(1, width // 64), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if (
                isinstance(module, torch.nn.Linear)
                and name.startswith("blocks.")
                and int(name.split(".")[1]) % 2 == 0
            ):
                rows, cols = module.weight.shape
                sigma_hat = float(module.weight.std())
                edge = sigma_hat * (math.sqrt(rows) + math.sqrt(cols))
                left, _ = torch.linalg.qr(torch.randn(rows, 4, generator=generator))
                right, _ = torch.linalg.qr(torch.randn(cols, 4, generator=generator))
                strengths = signal * edge * torch.tensor([1.0, 0.8, 0.6, 0.4])
                module.weight += left @ torch.diag(strengths) @ right.T
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--signal", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    import weightwatcher

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    model = build_model(arguments.width, arguments.layers, arguments.signal, arguments.seed)

    start = time.perf_counter()
    ours = weight_spectra(model)
    ours_seconds = time.perf_counter() - start

    watcher = weightwatcher.WeightWatcher(model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        details = watcher.analyze(randomize=False, mp_fit=True, plot=False)
        theirs_seconds = time.perf_counter() - start

    # WeightWatcher names layers by module; q, k, v of the packed qkv are one weight there, so compare the
    # weights both tools see whole: every nn.Linear other than the packed qkv.
    by_name = {spectrum.layer: spectrum for spectrum in ours}
    rows = []
    alpha_errors, rank_errors = [], []
    for _, layer in details.iterrows():
        name = layer["longname"]
        spectrum = by_name.get(name)
        if spectrum is None:
            continue
        alpha_errors.append(abs(spectrum.alpha - layer["alpha"]) / layer["alpha"])
        rank_errors.append(abs(spectrum.stable_rank - layer["stable_rank"]) / layer["stable_rank"])
        rows.append(
            [
                name,
                f"{spectrum.rows}×{spectrum.cols}",
                f"{spectrum.alpha:.3f}",
                f"{layer['alpha']:.3f}",
                f"{spectrum.stable_rank:.2f}",
                f"{layer['stable_rank']:.2f}",
                str(spectrum.mp_spikes),
                str(int(layer["num_spikes"])),
            ]
        )
    print(describe_machine())
    print(
        f"\nModel: DemoTransformer d_model={arguments.width}, {arguments.layers} blocks, rank-4 signal of "
        f"{arguments.signal}× the MP edge in even blocks; {len(rows)} weights compared "
        f"(weightwatcher {weightwatcher.__version__}).\n"
    )
    headers = [
        "weight",
        "N×M",
        "α ours",
        "α ww",
        "stable rank ours",
        "stable rank ww",
        "spikes ours",
        "spikes ww",
    ]
    print(markdown_table(headers, rows))
    print(
        f"\nmax relative difference: α {max(alpha_errors):.1e}, stable rank {max(rank_errors):.1e}\n"
        f"time: weight_spectra {ours_seconds:.3f} s for {len(ours)} weights (q, k, v split), "
        f"WeightWatcher.analyze {theirs_seconds:.3f} s; ratio {theirs_seconds / ours_seconds:.1f}×"
    )


if __name__ == "__main__":
    main()
