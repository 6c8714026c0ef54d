"""Top Hessian eigenvalues: spectral-monitor's curvature probe against PyHessian and hessian-eigenthings.

Same model (the demo transformer, 2 layers, d = 64), same batch, math SDPA kernel for everyone, in one run.
Each method is run until its answer is within 1e-3 relative error of a float64 reference (tightening its
own knob: PyHessian's ``tol``, hessian-eigenthings' Lanczos ``max_iter``, our ``tol``); the time of the
first setting that meets it is reported, with the products it used, as a multiple of PyHessian's time and
of one training step (forward + backward).

    python benchmarks/bench_hessian.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from spectral_monitor.demo import DemoTransformer
from spectral_monitor.probes.curvature import measure_curvature

TARGET = 1e-3


def build(dtype: torch.dtype) -> tuple[DemoTransformer, torch.Tensor, torch.Tensor]:
    model = DemoTransformer(vocab_size=64, d_model=64, n_layers=2, n_heads=4, seq_len=32, seed=0).to(dtype)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(64, (16, 32), generator=generator)
    # A few AdamW steps so the Hessian is that of a model in training, not of the initialisation.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(20):
            optimizer.zero_grad()
            criterion(model(tokens), tokens.roll(1, 1)).backward()
            optimizer.step()
    model.zero_grad(set_to_none=True)
    return model, tokens, tokens.roll(1, 1)


def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def timed(run, repeats: int):
    seconds, output = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        output = run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import hessian_eigenthings as eigenthings  # the bench extra
    from pyhessian import hessian as pyhessian_hessian

    with sdpa_kernel(SDPBackend.MATH):
        reference_model, tokens, targets = build(torch.float64)
        reference = measure_curvature(
            reference_model,
            lambda: criterion(reference_model(tokens), targets),
            top_k=3,
            tol=1e-10,
            max_products=2000,
        ).eigenvalues.tolist()
        model, tokens, targets = build(torch.float32)
        loss = lambda: criterion(model(tokens), targets)  # noqa: E731
        step_seconds, _ = timed(lambda: torch.autograd.grad(loss(), list(model.parameters())), args.repeats)

        def error(values: list[float], k: int) -> float:
            return max(
                abs(v - r) / abs(r)
                for v, r in zip(sorted(values, reverse=True)[:k], reference[:k], strict=True)
            )

        rows = []

        def pyhessian_case(k: int):
            for tol in (1e-3, 1e-4, 1e-5, 1e-6):

                def run(tol=tol):
                    torch.manual_seed(0)
                    h = pyhessian_hessian(model.train(), criterion, data=(tokens, targets), cuda=False)
                    values, _ = h.eigenvalues(maxIter=200, tol=tol, top_n=k)
                    model.zero_grad(set_to_none=True)
                    return values

                seconds, values = timed(run, args.repeats)
                if error(values, k) <= TARGET:
                    return seconds, values, f"tol={tol:g}"
            return seconds, values, f"tol={tol:g} (target missed)"

        def eigenthings_case(k: int):
            operator = eigenthings.HessianOperator(
                model, [(tokens, targets)], lambda m, b: criterion(m(b[0]), b[1])
            )
            for steps in (8, 12, 16, 20, 30, 40, 60):
                seconds, result = timed(
                    lambda s=steps: eigenthings.lanczos(operator, k=k, max_iter=s, which="LA", seed=0),
                    args.repeats,
                )
                values = result.eigenvalues.tolist()
                if error(values, k) <= TARGET:
                    return seconds, values, f"max_iter={steps}"
            return seconds, values, f"max_iter={steps} (target missed)"

        def ours(k: int, warm_from=None):
            for tol in (1e-2, 1e-3, 1e-4, 1e-5):
                seconds, estimate = timed(
                    lambda t=tol: measure_curvature(
                        model, loss, top_k=k, tol=t, max_products=400, warm=warm_from
                    ),
                    args.repeats,
                )
                if error(estimate.eigenvalues.tolist(), k) <= TARGET:
                    return seconds, estimate, f"tol={tol:g}, {estimate.products} products"
            return seconds, estimate, f"tol={tol:g} (target missed)"

        for k in (1, 3):
            ph_seconds, ph_values, ph_setting = pyhessian_case(k)
            rows.append((f"top-{k}", "PyHessian", ph_seconds, error(ph_values, k), ph_setting, ph_seconds))
            he_seconds, he_values, he_setting = eigenthings_case(k)
            rows.append(
                (f"top-{k}", "hessian-eigenthings", he_seconds, error(he_values, k), he_setting, ph_seconds)
            )
            cold_seconds, cold, cold_setting = ours(k)
            rows.append(
                (
                    f"top-{k}",
                    "spectral-monitor cold",
                    cold_seconds,
                    error(cold.eigenvalues.tolist(), k),
                    cold_setting,
                    ph_seconds,
                )
            )
            # Warm: the same Hessian from the cold run's Ritz vectors, the best case: in training the next
            # event's Hessian has moved by a few hundred steps.
            warm_seconds, warm, warm_setting = ours(k, cold.warm)
            rows.append(
                (
                    f"top-{k}",
                    "spectral-monitor warm",
                    warm_seconds,
                    error(warm.eigenvalues.tolist(), k),
                    warm_setting,
                    ph_seconds,
                )
            )

    print(
        f"reference (float64) top-3: {[f'{v:.6g}' for v in reference]}; training step {step_seconds:.4f} s; "
        f"{torch.get_num_threads()} thread(s); torch {torch.__version__}"
    )
    print("| case | method | median time (s) | / PyHessian | / training step | rel. error | setting |")
    print("|---|---|---:|---:|---:|---:|---|")
    for case, method, seconds, err, setting, baseline in rows:
        print(
            f"| {case} | {method} | {seconds:.3f} | {seconds / baseline:.2f} | "
            f"{seconds / step_seconds:.1f} | "
            f"{err:.1e} | {setting} |"
        )


if __name__ == "__main__":
    main()
