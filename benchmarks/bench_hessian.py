"""Top Hessian eigenvalues over the events of a run: spectral-monitor's curvature probe against PyHessian and
hessian-eigenthings, every method judged at every event against exact eigenvalues.

Two runs, each a list of curvature events as a callback meets them:

- ``eos``: full-batch gradient descent (η = 0.8) on a tanh MLP (8 → 32 → 32 → 4, 1,476 parameters) fitting a
  random teacher by MSE, trained 1,000 steps to the edge of stability, then 20 events every 6 steps. The
  reference is the explicit float64 Hessian of each event's parameters and a dense symmetric eigensolver.
- ``trained``: the demo transformer (2 layers, d = 64, 110,400 parameters) after 300 AdamW steps on one batch
  (loss 0.005: one outlier eigenvalue over a bulk whose top values nearly coincide), 5 events every 5 steps
  up to step 300. The reference is the certified solve of the same weights in float64 to 1e-10, checked
  against a second one from another start and block width.

Accuracy first, over ALL events: PyHessian's ``tol`` and hessian-eigenthings' Lanczos ``max_iter`` walk a
ladder from loose to tight, and each method keeps the loosest setting at which every event's top-k is within
1e-3 relative error of the reference. spectral-monitor runs as it does in training: its default ``tol``
(1e-3, certified), each event from a fresh random start.
Products are counted by wrapping each method's own Hessian-vector product. Then time: every method over the
whole run, the methods interleaved, ``--repeats`` rounds; per-event time is the median round's total over
the events, each ratio the median of the per-round ratios against PyHessian, with its range (load on a
shared machine hits all sides alike). Every time includes building the graph the products need (PyHessian's
and ours: one forward and a ``create_graph`` gradient per event, kept; hessian-eigenthings rebuilds it for
every product).

    PYTHONPATH=$PWD python benchmarks/bench_hessian.py --threads 1 --repeats 3
    PYTHONPATH=$PWD python benchmarks/bench_hessian.py --runs eos --device cuda
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from _common import describe_machine, markdown_table
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from spectral_monitor.demo import DemoTransformer
from spectral_monitor.probes._autodiff import probing
from spectral_monitor.probes.curvature import (
    HessianOperator,
    ParameterSpace,
    hessian_eigenvalues,
    measure_curvature,
)

TARGET = 1e-3
MONITOR_TOL = 1e-3
PYHESSIAN_TOLERANCES = (1e-1, 5e-2, 2e-2, 1e-2, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4, 1e-4, 5e-5, 2e-5, 1e-5, 1e-6)
EIGENTHINGS_STEPS = (4, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100)


@dataclass
class Run:
    """A model whose parameters are set to each event's in turn, the loss on its batch, the references."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    events: list[dict[str, torch.Tensor]]
    reference: list[list[float]]  # per event, the top-3 descending

    def load(self, event: int) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(self.events[event][name])

    def loss(self) -> torch.Tensor:
        return self.criterion(self.model(self.inputs), self.targets)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).square().mean()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def edge_of_stability_run(device: torch.device, warmup: int = 1000, events: int = 20, every: int = 6) -> Run:
    """Gradient descent at η = 0.8 on the tanh MLP, events after ``warmup`` steps, every ``every`` steps."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        y = 3 * teacher(x)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.8)
    snapshots = []
    for step in range(warmup + events * every):
        if step >= warmup and (step - warmup) % every == 0:
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        optimizer.zero_grad()
        mse(model(x), y).backward()
        optimizer.step()
    reference = [explicit_top(model, x, y, snapshot) for snapshot in snapshots]
    model.zero_grad(set_to_none=True)
    return Run("eos", model.to(device), x.to(device), y.to(device), mse, _to(snapshots, device), reference)


def explicit_top(model: nn.Module, x: torch.Tensor, y: torch.Tensor, parameters: dict) -> list[float]:
    """The top-3 eigenvalues of the explicit float64 Hessian of the MSE at ``parameters``."""
    net = copy.deepcopy(model).double()
    names = list(parameters)
    shapes = [parameters[name].shape for name in names]
    flat = torch.cat([parameters[name].double().reshape(-1) for name in names])

    def loss_of(vector: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(vector, [s.numel() for s in shapes])
        swapped = {n: p.reshape(s) for n, p, s in zip(names, pieces, shapes, strict=True)}
        return mse(torch.func.functional_call(net, swapped, (x.double(),)), y.double())

    hessian = torch.autograd.functional.hessian(loss_of, flat, vectorize=True)
    return torch.linalg.eigvalsh(hessian)[-3:].flip(0).tolist()


def trained_transformer_run(device: torch.device, steps: int = 300, events: int = 5, every: int = 5) -> Run:
    """The demo transformer under AdamW on one batch; events at the last ``events`` multiples of ``every``."""
    model = DemoTransformer(vocab_size=64, d_model=64, n_layers=2, n_heads=4, seq_len=32, seed=0)
    tokens = torch.randint(64, (16, 32), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    snapshots = []
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            token_cross_entropy(model(tokens), targets).backward()
            optimizer.step()
            if step > steps - events * every and step % every == 0:
                snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    model.eval()
    reference = [float64_reference(model, tokens, targets, snapshot) for snapshot in snapshots]
    return Run(
        "trained",
        model.to(device),
        tokens.to(device),
        targets.to(device),
        token_cross_entropy,
        _to(snapshots, device),
        reference,
    )


def float64_reference(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, parameters: dict
) -> list:
    """Top-3 of ``parameters`` in float64 to 1e-10, checked against a second run from another start and
    width."""
    model = copy.deepcopy(model).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(parameters[name])
    runs = [
        measure_curvature(
            model,
            lambda: token_cross_entropy(model(tokens), targets),
            top_k=3,
            tol=1e-10,
            max_products=2000,
            block_size=width,
            generator=torch.Generator().manual_seed(seed),
        )
        for seed, width in ((0, 1), (1, 3))
    ]
    first, second = (run.eigenvalues for run in runs)
    disagreement = float(((first - second).abs() / first.abs()).max())
    if not all(run.converged for run in runs) or disagreement > 1e-8:
        raise RuntimeError(f"the float64 references disagree by {disagreement:.1e}")
    return first.tolist()


def _to(snapshots: list[dict[str, torch.Tensor]], device: torch.device) -> list[dict[str, torch.Tensor]]:
    return [{name: value.to(device) for name, value in snapshot.items()} for snapshot in snapshots]


@dataclass
class Method:
    """One method at one setting: ``solve(event, k)`` returns (values, products) for the loaded event."""

    label: str
    setting: str
    solve: Callable[[int, int], tuple[list[float], int]]


def worst_error(run: Run, method: Method, k: int) -> tuple[float, float]:
    """The largest relative error of the top-k over every event, and the mean products per event."""
    worst, products = 0.0, 0
    for event in range(len(run.events)):
        run.load(event)
        values, spent = method.solve(event, k)
        top = sorted(values, reverse=True)[:k]
        reference = run.reference[event][:k]
        worst = max(worst, *(abs(v - r) / abs(r) for v, r in zip(top, reference, strict=True)))
        products += spent
    return worst, products / len(run.events)


def loosest(run: Run, label: str, settings, make: Callable, k: int) -> tuple[Method, float, float]:
    """The first setting of the ladder (loose to tight) at which every event meets the target."""
    for setting in settings:
        method = make(setting)
        worst, products = worst_error(run, method, k)
        if worst <= TARGET:
            return method, worst, products
    return Method(f"{label} (target missed)", method.setting, method.solve), worst, products


def methods_for(run: Run, device: torch.device) -> dict[str, Callable]:
    import hessian_eigenthings as eigenthings

    pyhessian_module = sys.modules["pyhessian.hessian"]
    counter = {"products": 0}
    hessian_vector_product = pyhessian_module.hessian_vector_product

    def counted_product(*arguments):
        counter["products"] += 1
        return hessian_vector_product(*arguments)

    pyhessian_module.hessian_vector_product = counted_product
    cuda = device.type == "cuda"

    def pyhessian_at(tol: float) -> Method:
        def solve(event: int, k: int):
            counter["products"] = 0
            torch.manual_seed(event)
            h = pyhessian_module.hessian(run.model, run.criterion, data=(run.inputs, run.targets), cuda=cuda)
            values, _ = h.eigenvalues(maxIter=500, tol=tol, top_n=k)
            run.model.zero_grad(set_to_none=True)  # PyHessian leaves graph-attached tensors in .grad
            return values, counter["products"]

        return Method("PyHessian", f"tol={tol:g}", solve)

    operator = eigenthings.HessianOperator(
        run.model, [(run.inputs, run.targets)], lambda m, b: run.criterion(m(b[0]), b[1])
    )
    matvec = operator.matvec

    def counted_matvec(vector):
        counter["products"] += 1
        return matvec(vector)

    operator.matvec = counted_matvec

    def eigenthings_at(steps: int) -> Method:
        def solve(event: int, k: int):
            counter["products"] = 0
            result = eigenthings.lanczos(operator, k=k, max_iter=steps, which="LA", seed=event)
            return result.eigenvalues.tolist(), counter["products"]

        return Method("hessian-eigenthings", f"max_iter={steps}", solve)

    def monitor() -> Method:
        def solve(event: int, k: int):
            estimate = measure_curvature(run.model, run.loss, top_k=k, tol=MONITOR_TOL, max_products=400)
            return estimate.eigenvalues.tolist(), estimate.products

        return Method("spectral-monitor", f"tol={MONITOR_TOL:g}", solve)

    return {"pyhessian": pyhessian_at, "eigenthings": eigenthings_at, "monitor": monitor}


def compare(run: Run, device: torch.device, repeats: int) -> None:
    makers = methods_for(run, device)
    print(
        f"\n### {run.name}: {len(run.events)} events; reference top-3 at the first event "
        f"{', '.join(f'{v:.5g}' for v in run.reference[0])}, at the last "
        f"{', '.join(f'{v:.5g}' for v in run.reference[-1])}\n"
    )
    rows = []
    for k in (1, 3):
        cases = [
            loosest(run, "PyHessian", PYHESSIAN_TOLERANCES, makers["pyhessian"], k),
            loosest(
                run,
                "hessian-eigenthings",
                [s for s in EIGENTHINGS_STEPS if s >= k + 1],
                makers["eigenthings"],
                k,
            ),
        ]
        method = makers["monitor"]()
        cases.append((method, *worst_error(run, method, k)))
        seconds: dict[str, list[float]] = {case[0].label: [] for case in cases}
        steps: list[float] = []
        for _ in range(repeats):
            steps.append(timed(lambda: training_step(run), device))
            for method, _, _ in cases:
                seconds[method.label].append(timed(lambda m=method, k=k: whole_run(run, m, k), device))
        baseline = seconds[cases[0][0].label]
        per_event = len(run.events)
        for method, worst, products in cases:
            times = seconds[method.label]
            rows.append(
                [
                    f"top-{k}",
                    method.label,
                    method.setting,
                    f"{products:.1f}",
                    f"{1000 * statistics.median(times) / per_event:.1f}",
                    _median_and_range([t / b for t, b in zip(times, baseline, strict=True)]),
                    f"{statistics.median(times) / per_event / statistics.median(steps):.1f}",
                    f"{worst:.1e}",
                ]
            )
    headers = [
        "case",
        "method",
        "setting",
        "products / event",
        "ms / event",
        "/ PyHessian",
        "/ training step",
        "max rel. error (all events)",
    ]
    print(markdown_table(headers, rows))


def whole_run(run: Run, method: Method, k: int) -> None:
    for event in range(len(run.events)):
        run.load(event)
        method.solve(event, k)


def training_step(run: Run) -> None:
    torch.autograd.grad(run.loss(), list(run.model.parameters()))


def product_costs(run: Run, device: torch.device, repeats: int) -> None:
    """Milliseconds per Hessian-vector product: the monitor's two methods against the hand-written double
    backward (``torch.autograd.grad(grads, params, v)`` with ``grads`` kept with ``create_graph=True``)."""
    run.load(len(run.events) - 1)
    space = ParameterSpace.of(run.model)
    vector = torch.randn(1, space.size, 1, generator=torch.Generator().manual_seed(0)).to(device)
    with probing(run.model):
        operators = {m: HessianOperator(run.loss, space, m, run.model) for m in ("autograd", "func")}
        parameters = space.parameters
        gradients = torch.autograd.grad(run.loss(), parameters, create_graph=True)
        pieces = [v[0] for v in space.unflatten(vector[0].T)]
        runs = {
            "spectral-monitor autograd (default)": lambda: operators["autograd"].matmat(vector),
            "spectral-monitor func": lambda: operators["func"].matmat(vector),
            "double backward (PyHessian's)": lambda: torch.autograd.grad(
                gradients, parameters, grad_outputs=pieces, retain_graph=True
            ),
        }
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(repeats):
            for label, product in runs.items():
                seconds[label].append(timed(lambda p=product: [p() for _ in range(20)], device) / 20)
    baseline = seconds["double backward (PyHessian's)"]
    rows = [
        [
            label,
            f"{1000 * statistics.median(times):.3f}",
            _median_and_range([t / b for t, b in zip(times, baseline, strict=True)]),
        ]
        for label, times in seconds.items()
    ]
    print(f"\nOne Hessian-vector product on the {run.name} model (last event):\n")
    print(markdown_table(["product", "ms", "/ double backward"], rows))


def solver_share(run: Run, device: torch.device, repeats: int) -> None:
    """The top-1 solve's own work, apart from its products: every event's Hessian operator built once (the
    graph is not counted), its products timed inside the solve, the rest is the solver's."""
    space = ParameterSpace.of(run.model)
    solves, products, counts = [], [], []
    for _ in range(repeats):
        total = product_seconds = 0.0
        count = 0
        for event in range(len(run.events)):
            run.load(event)
            with probing(run.model):
                operator = HessianOperator(run.loss, space, "autograd", run.model)
                matmat = operator.matmat

                def timed_matmat(x: torch.Tensor, matmat=matmat) -> torch.Tensor:
                    nonlocal product_seconds
                    start = time.perf_counter()
                    y = matmat(x)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    product_seconds += time.perf_counter() - start
                    return y

                operator.matmat = timed_matmat
                total += timed(
                    lambda o=operator: hessian_eigenvalues(o, 1, tol=MONITOR_TOL, max_products=400), device
                )
                count += operator.products
        solves.append(total / len(run.events))
        products.append(product_seconds / len(run.events))
        counts.append(count / len(run.events))
    solve, product = statistics.median(solves), statistics.median(products)
    print(
        f"\nTop-1 solve on the {run.name} model, graph built beforehand (median of {repeats} rounds): "
        f"{1000 * solve:.2f} ms an event, {counts[0]:.1f} products taking {1000 * product:.2f} ms, "
        f"the solver's own work {1000 * (solve - product):.2f} ms ({100 * (solve - product) / solve:.0f}%)"
    )


def _median_and_range(ratios: list[float]) -> str:
    """The median of per-round ratios and their range: the spread a shared machine puts on them."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


RUNS = {"eos": edge_of_stability_run, "trained": trained_transformer_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import hessian_eigenthings  # noqa: F401  (the bench extra)
    import pyhessian  # noqa: F401  (registers pyhessian.hessian)

    device = torch.device(args.device)
    print(describe_machine())
    print(f"torch {torch.__version__}, device {device}, {args.repeats} interleaved rounds")
    for name in args.runs:
        with sdpa_kernel(SDPBackend.MATH):
            run = RUNS[name](device)
            product_costs(run, device, args.repeats)
            solver_share(run, device, args.repeats)
            compare(run, device, args.repeats)


if __name__ == "__main__":
    main()
