"""What a monitor measures, how often and with which limits: :class:`MonitorOptions`, validated when made.

Every integration (the Lightning callback, and any other) takes these options, by keyword, and hands them
to :class:`~spectral_monitor.core.MonitorSession`; their meaning is documented once, on
:class:`~spectral_monitor.SpectralMonitor`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from spectral_monitor.alerts import AlertConfig, AlertEvent
from spectral_monitor.core.second_order import (
    OPT_IN_FAMILIES,
    CurvatureOptions,
    JacobianOptions,
    NTKOptions,
    ProbeDataOptions,
)
from spectral_monitor.metrics import METHODS as METRIC_METHODS
from spectral_monitor.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_instance,
    check_int,
    check_names,
    check_number,
    check_patterns,
)

__all__ = ["ALL_FAMILIES", "FAMILIES", "MIN_MEMORY_BUDGET_MB", "PRESETS", "MonitorOptions"]

FAMILIES = ("attention", "tokens", "weights")
"""What the monitor can observe: attention matrices, residual-stream tokens, weight matrices."""
ALL_FAMILIES = (*FAMILIES, *OPT_IN_FAMILIES)
"""Every family a monitor may measure: the opt-in ones are turned on by their options objects."""

_OPTIONS_CLASSES = {"curvature": CurvatureOptions, "jacobian": JacobianOptions, "ntk": NTKOptions}

MIN_MEMORY_BUDGET_MB = 2**-10
"""The smallest ``memory_budget_mb`` (1 KiB): below it the attention capture has no byte to hold."""

PRESETS: dict[str, dict[str, Any]] = {
    "light": {
        "families": ("attention", "weights"),
        "per_head": False,
        "histograms": False,
        "figures_every_n_logs": 0,
        "head_diversity_every_n_logs": 0,
        "weight_spectra_every_n_logs": 0,
        "curvature": None,
    },
    "standard": {
        "families": FAMILIES,
        "per_head": False,
        "histograms": True,
        "figures_every_n_logs": 10,
        "head_diversity_every_n_logs": 4,
        "weight_spectra_every_n_logs": 0,
        "curvature": None,
    },
    "full": {
        "families": FAMILIES,
        "per_head": True,
        "histograms": True,
        "figures_every_n_logs": 10,
        "head_diversity_every_n_logs": 1,
        "weight_spectra_every_n_logs": 10,
        "curvature": CurvatureOptions,  # made anew for each monitor: options are mutable
    },
}
"""What each ``preset`` sets, for the arguments left at None: ``"light"``, the attention and weight
scalars alone (no tokens, histograms, figures or head diversity); ``"standard"``, the defaults;
``"full"``, per-head scalars, head diversity on every logging step, weight spectra every 10th and the
loss-Hessian probe with :class:`CurvatureOptions`' defaults."""


@dataclass
class MonitorOptions:
    """The monitor's options (each one's meaning: :class:`~spectral_monitor.SpectralMonitor`'s arguments).

    Made valid or not at all: a value out of range raises a ValueError naming the argument. An argument
    left at None takes the ``preset``'s value (:data:`PRESETS`). ``families`` names what to measure among
    :data:`FAMILIES`; an opt-in family (:data:`OPT_IN_FAMILIES`) is turned on by its options object alone
    (``curvature=CurvatureOptions()``), and ``families`` then ends up naming it too.
    ``stop_on`` is checked against the rules that run when a :class:`~spectral_monitor.core.MonitorSession`
    is made from the options.
    """

    every_n_steps: int = 50
    families: Sequence[str] | None = None
    include: Sequence[str] | None = None
    exclude: Sequence[str] | None = None
    max_sequences: int = 2
    memory_budget_mb: float = 256.0
    per_head: bool | None = None
    histograms: bool | None = None
    figures_every_n_logs: int | None = None
    metric_method: str = "auto"
    attention_rank_sums: bool = True
    strict: bool = False
    log_first_step: bool = True
    curvature: CurvatureOptions | None = None
    jacobian: JacobianOptions | None = None
    ntk: NTKOptions | None = None
    probe_data: ProbeDataOptions | None = None
    head_diversity_every_n_logs: int | None = None
    weight_spectra_every_n_logs: int | None = None
    preflight: bool = True
    preflight_context_length: int | None = None
    alerts: AlertConfig | None = None
    on_alert: Callable[[AlertEvent], Any] | None = None
    stop_on: Sequence[str] = ()
    token_mask: Callable[[Any], Tensor | None] | None = None
    output_logits: bool | str = False
    preset: str = "standard"

    def __post_init__(self) -> None:
        check_choice("preset", self.preset, tuple(PRESETS))
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, value() if isinstance(value, type) else value)
        check_int("every_n_steps", self.every_n_steps, smallest=1)
        named_opt_in = (
            [name for name in self.families if name in OPT_IN_FAMILIES]
            if isinstance(self.families, (list, tuple))
            else []
        )
        if named_opt_in:
            name = named_opt_in[0]
            raise ValueError(
                f"families names the opt-in family {name!r}; families are drawn from {list(FAMILIES)}, and "
                f"{name} is turned on by its options: {name}={_OPTIONS_CLASSES[name].__name__}(...)"
            )
        families = tuple(dict.fromkeys(check_names("families", self.families, allowed=FAMILIES)))
        self.include = check_patterns("include", self.include)
        self.exclude = check_patterns("exclude", self.exclude)
        check_int("max_sequences", self.max_sequences, smallest=1)
        self.memory_budget_mb = check_number(
            "memory_budget_mb",
            self.memory_budget_mb,
            at_least=MIN_MEMORY_BUDGET_MB,
            unit="positive number of megabytes",
        )
        check_bool("per_head", self.per_head)
        if not isinstance(self.output_logits, (bool, str)) or self.output_logits == "":
            raise ValueError(
                "output_logits must be True, False or the name of the LM head module, "
                f"got {self.output_logits!r}"
            )
        check_bool("histograms", self.histograms)
        check_int("figures_every_n_logs", self.figures_every_n_logs, smallest=0)
        check_choice("metric_method", self.metric_method, METRIC_METHODS)
        check_bool("attention_rank_sums", self.attention_rank_sums)
        check_bool("strict", self.strict)
        check_bool("log_first_step", self.log_first_step)
        given = {"curvature": self.curvature, "jacobian": self.jacobian, "ntk": self.ntk}
        self.families = families + tuple(name for name, value in given.items() if value is not None)
        if not self.families:
            raise ValueError(
                f"families must name at least one of {list(FAMILIES)} unless an opt-in probe's options are "
                "given (curvature=, jacobian= or ntk=)"
            )
        self.curvature = check_instance("curvature", self.curvature, CurvatureOptions)
        self.jacobian = check_instance("jacobian", self.jacobian, JacobianOptions)
        self.ntk = check_instance("ntk", self.ntk, NTKOptions)
        self.probe_data = check_instance("probe_data", self.probe_data, ProbeDataOptions)
        check_int("head_diversity_every_n_logs", self.head_diversity_every_n_logs, smallest=0)
        check_int("weight_spectra_every_n_logs", self.weight_spectra_every_n_logs, smallest=0)
        check_bool("preflight", self.preflight)
        if self.preflight_context_length is not None:
            check_int("preflight_context_length", self.preflight_context_length, smallest=2)
        check_callable("token_mask", self.token_mask, "a function of the batch returning its token mask")
