"""The entries of the metric catalogue: one :class:`MetricInfo` per metric the monitor writes, one
:class:`Diagnosis` per default alert rule, and the dashboard groups they fall in.

A new metric is one entry of :data:`CATALOG` here; :mod:`spectral_monitor.catalog` answers questions about
the entries (which metric a tag names, which group, which diagnosis reads it) and renders the metrics
reference page from them. Plain data with no dependency on torch or Lightning. The alert thresholds are not
copied here: :attr:`MetricInfo.thresholds` and :attr:`Diagnosis.combine` read them from the rules in
:mod:`spectral_monitor.alerts.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

    from spectral_monitor.alerts.rules import AlertThreshold, Rule

__all__ = [
    "CATALOG",
    "DIAGNOSES",
    "FAMILY_GROUPS",
    "GROUPS",
    "HEALTHY_DIRECTIONS",
    "Diagnosis",
    "MetricInfo",
]

GROUPS = (
    "Rank collapse",
    "Entropy",
    "Token collapse",
    "Signal propagation",
    "Curvature",
    "Weights",
    "Alerts",
    "Overhead",
)
"""The dashboard groups (TensorBoard Custom Scalars categories), in the order they are shown."""

FAMILY_GROUPS = {
    "tokens": "Token collapse",
    "weights": "Weights",
    "jacobian": "Signal propagation",
    "curvature": "Curvature",
    "ntk": "Curvature",
    "alerts": "Alerts",
    "outputs": "Entropy",
}
"""The group of a metric the catalogue does not list, by family (attention has none: its metrics split
between rank collapse and entropy)."""

HEALTHY_DIRECTIONS = ("higher", "lower", "middle", "steady", "none")
"""Which way a metric is healthy: ``middle`` = away from both ends of its range, ``steady`` = slow change
(its trend matters, not its level), ``none`` = a reading, not a judgement."""

_AGGREGATES = ("min", "max")
_HEAD_SAMPLE_ERROR = "_head_se"
"""Suffix of a per-layer mean's standard error where the cost budget measured some of the heads."""
_NUMBERED = "<k>"
"""A name holding ``<k>`` stands for a numbered series: ``hessian_eigenvalue_<k>`` is ``_1``, ``_2``, ..."""


@dataclass(frozen=True)
class MetricInfo:
    """What one metric of the monitor is: one row of the metrics reference page.

    Attributes:
        family: the first part of its tags (``attention``, ``tokens``, ``weights``, ``curvature``,
            ``jacobian``, ``ntk``, ``alerts``).
        name: the second part (``<k>`` in a numbered series: ``hessian_eigenvalue_<k>``).
        range: its unit or range.
        healthy: one of :data:`HEALTHY_DIRECTIONS`.
        meaning: its definition, in one line.
        collapse: what trouble looks like in it (empty when it judges nothing).
        reference: the paper it comes from (empty for bookkeeping).
        group: the dashboard group (one of :data:`GROUPS`).
        layer: what the third part of its tags names (an attention module, a block, a weight, ...).
        written: when it is written (every logging step by default, or the argument that turns it on).
        head_aggregates: ``"min"``/``"max"``: also written per layer as ``<name>_min``/``<name>_max`` over
            heads, for the metrics whose spread across heads diagnoses something.
        per_head: has a value per head (a scalar ``.../head_h`` with ``per_head=True``).
        histogram: its per-head values are written as the histogram ``<family>/<name>_per_head/<layer>``.
        heatmap: drawn as a layer × head image ``attention/figures/<name>`` on figure steps.
        key: a row of ``spectral-monitor report``'s per-layer table.
        accuracy: how far the value written may be from its definition where it is estimated, not computed
            exactly (empty where it is exact up to rounding); shown with the definition.

    Raises:
        ValueError: ``healthy`` is not one of :data:`HEALTHY_DIRECTIONS`, ``group`` not one of
            :data:`GROUPS`, or ``head_aggregates`` not drawn from ``min``/``max`` of a per-head metric.

    Examples:
        >>> info = MetricInfo(
        ...     "attention", "peak_attention", "[0, 1]", "lower", "mean over queries of maxⱼ Aᵢⱼ",
        ...     "→ 1: every query on one key", "", "Entropy", "attention module",
        ...     head_aggregates=("max",), per_head=True,
        ... )
        >>> info.full_name, info.written_names
        ('attention/peak_attention', ('attention/peak_attention', 'attention/peak_attention_max'))
        >>> info.thresholds  # no default alert rule reads it
        ()
    """

    family: str
    name: str
    range: str
    healthy: str
    meaning: str
    collapse: str
    reference: str
    group: str
    layer: str
    written: str = "every logging step"
    head_aggregates: tuple[str, ...] = ()
    per_head: bool = False
    histogram: bool = False
    heatmap: bool = False
    key: bool = False
    accuracy: str = ""

    def __post_init__(self) -> None:
        if self.healthy not in HEALTHY_DIRECTIONS:
            raise ValueError(f"healthy of {self.full_name} must be one of {HEALTHY_DIRECTIONS}")
        if self.group not in GROUPS:
            raise ValueError(f"group of {self.full_name} must be one of {GROUPS}, got {self.group!r}")
        if not set(self.head_aggregates) <= set(_AGGREGATES) or (self.head_aggregates and not self.per_head):
            raise ValueError(
                f"head_aggregates of {self.full_name} must be drawn from {_AGGREGATES}, per head"
            )

    @property
    def full_name(self) -> str:
        """``family/name``."""
        return f"{self.family}/{self.name}"

    @property
    def thresholds(self) -> tuple[AlertThreshold, ...]:
        """The default alert rules' conditions on this metric, read from the rules themselves, in the order
        of :func:`~spectral_monitor.alerts.default_rules`."""
        return _alert_rules().default_thresholds(self.full_name)

    @property
    def written_names(self) -> tuple[str, ...]:
        """The ``family/metric`` names its scalars are written under: itself and its head aggregates."""
        return (self.full_name, *(f"{self.full_name}_{aggregate}" for aggregate in self.head_aggregates))


@dataclass(frozen=True)
class Diagnosis:
    """A default alert rule read as a diagnosis.

    Its conditions (the :class:`~spectral_monitor.alerts.rules.AlertThreshold` s the rule puts on the
    catalogue's metrics) combine with :attr:`combine` (``any``/``all``) and, on attention, must hold in
    every head of a layer, or in one head with :attr:`any_head` (then the head nearest to firing decides:
    ``_max`` of a ``>=`` condition, ``_min`` of a ``<=`` one). Both are read from the rule itself.

    Attributes:
        rule: The name of the default rule (:func:`~spectral_monitor.alerts.default_rules`).
        title: The verdict's name in ``spectral-monitor report``.
        meaning: What the verdict means, in one line.

    Examples:
        >>> entry = DIAGNOSES[0]
        >>> entry.rule, entry.title, entry.combine in ("any", "all"), isinstance(entry.any_head, bool)
        ('rank_collapse', 'Rank collapse', True, True)
    """

    rule: str
    title: str
    meaning: str

    @property
    def combine(self) -> str:
        """How the rule combines its conditions: ``"any"`` or ``"all"`` (``ValueError`` if :attr:`rule`
        names no default rule)."""
        return self._default_rule().combine

    @property
    def any_head(self) -> bool:
        """Whether one head of a layer suffices for the rule (``ValueError`` if :attr:`rule` names no
        default rule)."""
        return self._default_rule().any_head

    def _default_rule(self) -> Rule:
        rules = _alert_rules().default_rules()
        for rule in rules:
            if rule.name == self.rule:
                return rule
        raise ValueError(
            f"rule of the diagnosis {self.title!r} must name a default alert rule, one of "
            f"{[rule.name for rule in rules]}, got {self.rule!r}"
        )


_ATTENTION = "attention module"
_HEADS = "the spread over heads is written as"
_BLOCK = "transformer block"
_WEIGHT = "weight (`.q`/`.k`/`.v` split out of attention)"
_MODEL = "`model`, or a parameter block"

CATALOG: tuple[MetricInfo, ...] = (
    MetricInfo(
        "attention", "entropy", "[0, 1]", "middle",
        "mean over queries of −Σⱼ Aᵢⱼ log Aᵢⱼ / log(keys of row i)",
        "→ 0 in every head: entropy collapse (precedes loss spikes); → 1 in every head of a bidirectional "
        "layer: uniform attention", "Zhai et al. 2023", "Entropy", _ATTENTION,
        head_aggregates=("min", "max"), per_head=True, histogram=True, heatmap=True, key=True,
    ),
    MetricInfo(
        "attention", "sigma1", "[1, √(max column sum)]", "lower", "σ₁, the top singular value of A",
        "≫ 1: an attention sink (one key column takes most of the mass; common and healthy in trained LMs)",
        "Xiao et al. 2023", "Rank collapse", _ATTENTION, head_aggregates=("max",), per_head=True,
    ),
    MetricInfo(
        "attention", "sigma2", "[0, σ₁]", "higher", "σ₂, the second singular value of A",
        "→ 0: A near rank one", "Nait Saada et al. 2025", "Rank collapse", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "spectral_gap", "[0, 1]", "lower", "1 − σ₂/σ₁",
        "→ 1: A near rank one (a single head there is normal: sinks, positional heads)",
        "Nait Saada et al. 2025", "Rank collapse", _ATTENTION, head_aggregates=("min", "max"), per_head=True,
        histogram=True, key=True,
    ),
    MetricInfo(
        "attention", "eigen_gap", "[0, 1]", "lower",
        "1 − |λ₂| of A; bidirectional attention only (a causal A's eigenvalues are its diagonal)",
        "→ 1 with entropy → 1: uniform attention, no lookup (long-context collapse)", "",
        "Rank collapse", _ATTENTION, head_aggregates=("min",), per_head=True,
    ),
    MetricInfo(
        "attention", "rank_one_residual", "[0, 1]", "higher", "‖A − 1āᵀ‖_F / ‖A‖_F, ā the mean row",
        "→ 0 in every head: every query attends alike, rank collapse", "Dong et al. 2021", "Rank collapse",
        _ATTENTION, head_aggregates=("min", "max"), per_head=True, histogram=True, heatmap=True, key=True,
    ),
    MetricInfo(
        "attention", "stable_rank", "[1, n]", "higher", "‖A‖_F² / σ₁²", "→ 1: collapse", "",
        "Rank collapse", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "effective_rank", "[1, min(n, m)]", "higher",
        "exp(entropy of σ/Σσ), the effective rank of A", "→ 1: collapse", "Roy & Vetterli 2007",
        "Rank collapse", _ATTENTION, per_head=True,
        accuracy="exact (every singular value) up to n = 1024 for causal or rectangular attention and up to "
        "512 otherwise; above, stochastic Lanczos quadrature whose effective_rank_se is an estimated "
        "standard error, not a bound: on trained and sharp attention at n = 1024–2048 (GPT-2, "
        "nn.TransformerEncoder, Gaussian q and k) up to 6% off at a reported se under 1% (4 to 11 se); on a "
        "fresh model's near-uniform attention, with its leading Ritz pairs deflated, within 1.4% and 2 se "
        "(n = 768–2048); a dense head whose quadrature is still above 0.75% se after two rounds, or whose "
        "tail is beneath float32 rounding, is factorised instead, exact with se 0; the blockwise path "
        "(n ≥ 4096 or over the memory budget) has no such fallback; `metric_method=\"exact\"` factorises "
        "every head (benchmarks/README.md)",
    ),
    MetricInfo(
        "attention", "effective_rank_ratio", "(0, 1]", "higher",
        "effective rank / min(valid rows, valid keys); its accuracy is effective_rank's",
        "→ 0 (1/n) in every head: rank collapse", "Roy & Vetterli 2007", "Rank collapse", _ATTENTION,
        head_aggregates=("min", "max"), per_head=True, histogram=True, heatmap=True, key=True,
    ),
    MetricInfo(
        "attention", "threshold_rank", "[1, min(n, m)]", "higher",
        "smallest k with Σ_{i≤k} σᵢ² ≥ 0.99 ‖A‖_F² (on the Krylov path only where σ₁, σ₂ reach it)",
        "→ 1: collapse", "", "Rank collapse", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "dobrushin", "[0, 1]", "higher",
        "½ maxᵢⱼ ‖Aᵢ − Aⱼ‖₁, Dobrushin's coefficient (bounds |λ₂|; submultiplicative over layers)",
        "→ 0: rows identical", "Dobrushin 1956", "Rank collapse", _ATTENTION, per_head=True,
        accuracy="exact up to 32 queries; above, a lower bound L, half the largest distance from the 8 rows "
        "farthest from the mean row to any row, with τ/2 ≤ L ≤ τ; within 0.6% of τ on Gaussian q, k and 1.2% "
        "on a fresh nn.TransformerEncoder's padded heads at n = 512, equal to it on causal attention "
        "(benchmarks/README.md)",
    ),
    MetricInfo(
        "attention", "self_attention", "[0, 1]", "lower", "tr(A)/n, the mass each query keeps on itself",
        "→ 1: identity, no mixing", "", "Entropy", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "sink_mass", "[1/m, 1]", "none",
        "mean over real queries of the attention on the most-attended key column (the largest column mean of "
        "A over real queries, among attendable keys); uniform attention over m keys: 1/m",
        "→ 1: one key takes the mass of every query, an attention sink; normal in trained LMs, and such a "
        "head is rank one by design: read spectral_gap, rank_one_residual and effective_rank beside it "
        "(`rank_collapse` leaves out heads with sink_mass >= 0.5)",
        "Xiao et al. 2023; Gu et al. 2024", "Rank collapse", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "sink_mass_first", "[0, 1]", "none",
        "mean over real queries of the attention on the first real key (the first key any real query may "
        "attend: the first token after left padding)",
        "→ 1: a sink on the first token (BOS), the usual place of sinks in causal LMs",
        "Xiao et al. 2023; Gu et al. 2024", "Rank collapse", _ATTENTION, per_head=True,
    ),
    MetricInfo(
        "attention", "max_logit", "logit units", "steady",
        "largest scaled pre-softmax logit scale·q·k + bias over real queries × attendable keys, per head the "
        "largest over the sampled sequences (additive float biases such as ALiBi or T5's count; masked keys "
        "and padded queries do not)",
        "unbounded growth: attention-logit growth, which drives entropy collapse and precedes loss spikes "
        "(QK-Clip caps it per head)",
        "Dehghani et al. 2023; Wortsman et al. 2023; Kimi K2 (QK-Clip)", "Entropy", _ATTENTION,
        head_aggregates=("max",), per_head=True,
    ),
    MetricInfo(
        "attention", "max_logit_growth", "ratio > 0", "steady",
        "max_logit_max of this logging step / that of the layer's previous logging step (in checkpoints) "
        "(written from the second logging step, where the previous value is positive)",
        "persistently > 1 while the loss is flat: logits growing toward instability",
        "Wortsman et al. 2023", "Entropy", _ATTENTION,
    ),
    MetricInfo(
        "attention", "heads_measured", "[1, heads]", "none",
        "heads of the layer measured at this logging step under the attention cost budget "
        "(attention_cost_ratio); where fewer than all, a different set each logging step, every head within "
        "⌈heads / heads_measured⌉ of them, the layer's means are over those heads, and each mean "
        "<metric> has <metric>_head_se, its standard error as an estimate of the mean over every head "
        "(s/√k · √((H − k)/(H − 1)) over the k heads measured; not written for one head)",
        "", "", "Overhead", _ATTENTION, written="with a finite attention_cost_ratio (light, standard)",
    ),
    MetricInfo(
        "attention", "head_diversity", "[0, 1) bits", "higher",
        "mean Jensen–Shannon distance between the heads' normalised singular-value spectra",
        "→ 0: the heads have one rank structure (redundant heads)", "", "Rank collapse", _ATTENTION,
        written="every head_diversity_every_n_logs-th logging step",
    ),
    MetricInfo(
        "attention", "head_diversity_min", "[0, 1) bits", "higher",
        "the distance of the closest pair of heads", "→ 0: two heads with the same rank structure", "",
        "Rank collapse", _ATTENTION, written="every head_diversity_every_n_logs-th logging step",
    ),
    MetricInfo(
        "outputs", "max_logit", "logit units", "steady",
        "largest output logit of the LM head over the sampled sequences' real tokens × the vocabulary",
        "runaway growth: output-logit divergence", "Wortsman et al. 2023", "Entropy", "`model` (the LM head)",
        written="opt-in: output_logits",
    ),
    MetricInfo(
        "outputs", "log_partition", "logit units", "middle",
        "mean over the sampled sequences' real tokens of log Σ_v exp(logit_v), the LM head's log-partition "
        "(what PaLM's z-loss pulls toward 0)",
        "drifting far from 0 (either way): output-logit divergence, which the z-loss prevents",
        "Chowdhery et al. 2022 (PaLM); Wortsman et al. 2023", "Entropy", "`model` (the LM head)",
        written="opt-in: output_logits",
    ),
    MetricInfo(
        "tokens", "cosine_similarity", "[−1, 1]", "lower", "mean over i ≠ j of cos(xᵢ, xⱼ)",
        "→ 1 across depth: token collapse", "Noci et al. 2022", "Token collapse", _BLOCK, key=True,
    ),
    MetricInfo(
        "tokens", "token_residual", "[0, 1]", "higher", "‖X − 1x̄ᵀ‖_F / ‖X‖_F, x̄ the token mean",
        "→ 0: token collapse", "Dong et al. 2021", "Token collapse", _BLOCK, key=True,
    ),
    MetricInfo(
        "tokens", "stable_rank", "[1, min(n, d)]", "higher", "‖X‖_F² / σ₁² of the block's output",
        "→ 1: one direction", "", "Token collapse", _BLOCK,
    ),
    MetricInfo(
        "tokens", "effective_rank", "[1, min(n, d)]", "higher", "effective rank of the block's output",
        "→ 1: one direction", "Roy & Vetterli 2007", "Token collapse", _BLOCK,
    ),
    MetricInfo(
        "weights", "spectral_norm", "≥ 0", "steady", "σ₁(W), warm-started block Lanczos",
        "runaway growth", "", "Weights", _WEIGHT, per_head=True, histogram=True, key=True,
    ),
    MetricInfo(
        "weights", "frobenius_norm", "≥ 0", "steady", "‖W‖_F", "runaway growth", "", "Weights", _WEIGHT,
        per_head=True, histogram=True,
    ),
    MetricInfo(
        "weights", "stable_rank", "[1, min(N, M)]", "none", "‖W‖_F² / σ₁(W)²", "", "", "Weights", _WEIGHT,
        per_head=True, histogram=True,
    ),
    MetricInfo(
        "weights", "spectral_norm_residual", "≥ 0", "lower",
        "relative Ritz residual of the σ₁ estimate (σ₁'s relative error is about half of it)", "", "",
        "Weights", _WEIGHT, per_head=True,
    ),
    MetricInfo(
        "weights", "qk_spectral_norm", "≥ 0", "steady", "‖W_Q^hᵀ W_K^h‖₂ of each head, exact",
        "growth precedes entropy collapse", "Zhai et al. 2023", "Entropy", _ATTENTION, per_head=True,
        histogram=True,
    ),
    MetricInfo(
        "weights", "qk_spectral_norm_max", "≥ 0", "steady", "the largest ‖W_Q^hᵀ W_K^h‖₂ over heads",
        "growth precedes entropy collapse", "Zhai et al. 2023", "Entropy", _ATTENTION,
    ),
    *(
        MetricInfo("weights", name, unit, healthy, meaning, collapse, reference, "Weights", _WEIGHT,
                   written="every weight_spectra_every_n_logs-th logging step")  # fmt: skip
        for name, unit, healthy, meaning, collapse, reference in (
            ("mp_edge", "≥ 0", "none", "σ̂(√N + √M), σ̂² = ‖W‖_F²/(NM): the bulk edge of an iid matrix", "",
             "Marchenko & Pastur 1967"),
            ("mp_spikes", "count", "none", "#{σᵢ > mp_edge}: singular values above the noise bulk",
             "≈ 0 at initialisation; growth = learned structure", "Martin & Mahoney 2021"),
            ("alpha", "> 1", "middle", "power-law tail exponent of the eigenvalues σᵢ² (WeightWatcher's MLE)",
             "outside [2, 6] in a trained layer", "Martin & Mahoney 2021"),
            ("alpha_ks_distance", "[0, 1]", "lower", "Kolmogorov–Smirnov distance of the power-law fit", "",
             "Clauset et al. 2009"),
            ("energy_rank_90", "[1, min(N, M)]", "none", "smallest rank keeping 90% of ‖W‖_F²",
             "well below min(N, M): the layer can be factorised", ""),
            ("energy_rank_99", "[1, min(N, M)]", "none", "smallest rank keeping 99% of ‖W‖_F²",
             "well below min(N, M): the layer can be factorised", ""),
        )  # fmt: skip
    ),
    MetricInfo(
        "curvature", "sharpness", "≥ 0 (typically)", "none",
        "λ_max of the loss Hessian on the probe batch (Adam: of P^-1/2 H P^-1/2)",
        "past the edge of stability (see sharpness_ratio)", "Cohen et al. 2021", "Curvature", _MODEL,
        written="opt-in: curvature", key=True,
    ),
    MetricInfo(
        "curvature", "sharpness_threshold", "> 0", "none",
        "the optimizer's edge of stability: 2/η (SGD), (2+2β)/η (momentum), 38/η (Adam, β₁ = 0.9)", "",
        "Cohen et al. 2022", "Curvature", _MODEL, written="opt-in: curvature",
    ),
    MetricInfo(
        "curvature", "sharpness_ratio", "≥ 0", "lower", "sharpness / sharpness_threshold",
        "≈ 1 is the normal edge of stability; sustained ≥ 1.5: the loss is about to blow up",
        "Cohen et al. 2021", "Curvature", _MODEL, written="opt-in: curvature", key=True,
    ),
    MetricInfo(
        "curvature", f"hessian_eigenvalue_{_NUMBERED}", "real", "none",
        "the k-th largest algebraic eigenvalue of the loss Hessian (k = 1..top_k)", "", "Cohen et al. 2021",
        "Curvature", _MODEL, written="opt-in: curvature",
    ),
    MetricInfo(
        "curvature", "hessian_min_eigenvalue", "real", "none",
        "the most negative eigenvalue of the loss Hessian (min_eigenvalue=True)", "", "", "Curvature", _MODEL,
        written="opt-in: curvature",
    ),
    MetricInfo(
        "curvature", "hessian_trace", "real", "none", "tr H by Hutch++", "", "Meyer et al. 2021", "Curvature",
        _MODEL, written="opt-in: curvature",
    ),
    MetricInfo(
        "curvature", "hessian_trace_se", "≥ 0", "lower", "standard error of hessian_trace", "", "",
        "Curvature", _MODEL, written="opt-in: curvature",
    ),
    MetricInfo(
        "curvature", "gradient_alignment", "[0, 1]", "none",
        "|cos| between the top Hessian eigenvector and the gradient", "", "Gur-Ari et al. 2018", "Curvature",
        _MODEL, written="opt-in: curvature",
    ),
    MetricInfo(
        "jacobian", "jacobian_norm", "≥ 0", "steady", "‖∂x_l/∂x_{l−1}‖₂ of a block, for one sequence",
        "sustained growth ≫ 1: exploding signal", "", "Signal propagation", _BLOCK,
        written="opt-in: jacobian",
        key=True,
    ),
    MetricInfo(
        "jacobian", "residual_branch_norm", "≥ 0", "steady", "‖J − I‖₂ of a block: its residual branch alone",
        "sustained growth: the branch dominates the skip path", "", "Signal propagation", _BLOCK,
        written="opt-in: jacobian",
    ),
    MetricInfo(
        "jacobian", "end_to_end_norm", "≥ 0", "steady", "‖∂x_L/∂x_0‖₂ of the whole stack (layer `model`)",
        "sustained growth ≫ 1: exploding signal", "", "Signal propagation", "`model`",
        written="opt-in: jacobian",
        key=True,
    ),
    *(
        MetricInfo("ntk", name, unit, "none", meaning, "", "Jacot et al. 2018", "Curvature", "`model`",
                   written="opt-in: ntk")  # fmt: skip
        for name, unit, meaning in (
            ("ntk_trace", "≥ 0", "tr K of the empirical NTK of the probe examples"),
            ("ntk_max_eigenvalue", "≥ 0", "λ_max of the empirical NTK"),
            ("ntk_condition_number", "≥ 1", "λ_max/λ_min of the empirical NTK (inf when λ_min ≤ 0)"),
            ("ntk_effective_rank", "[1, examples]", "effective rank of the empirical NTK's eigenvalues"),
        )
    ),
    *(
        MetricInfo(family, name, unit, "lower", meaning, "", "", "Overhead", "`model`",
                   written=f"opt-in: {family}")
        for family in ("curvature", "jacobian", "ntk")
        for name, unit, meaning in (
            ("overhead_ms", "ms", f"wall time of the {family} probe at this step"),
            ("overhead_percent", "%", f"the {family} probe's time against the last training step"),
        )
    ),
    MetricInfo(
        "curvature", "every_n_steps", "≥ every_n_steps", "none",
        "steps from the last curvature event to the next, stretched to keep the probe under "
        "max_overhead_percent of training time", "", "", "Overhead", "`model`",
        written="opt-in: curvature, with max_overhead_percent (the step after each event)",
    ),
    MetricInfo(
        "alerts", "open", "count", "lower", "open alerts of the rule (the layer part names the rule)", "", "",
        "Alerts", "alert rule", written="every step the rules run",
    ),
    MetricInfo(
        "alerts", "fired", "count", "lower", "alerts of the rule fired so far (cumulative)", "", "",
        "Alerts", "alert rule", written="every step the rules run",
    ),
)  # fmt: skip
"""Every metric the monitor writes, attention first."""

DIAGNOSES: tuple[Diagnosis, ...] = (
    Diagnosis("rank_collapse", "Rank collapse", "every head of a layer rank one"),
    Diagnosis("uniform_attention", "Uniform attention", "every head of a bidirectional layer uniform"),
    Diagnosis("entropy_collapse", "Entropy collapse", "every head of a layer on one key per query"),
    Diagnosis("logit_growth", "Attention-logit growth", "a head's largest logit far past softmax saturation"),
    Diagnosis("token_collapse", "Token collapse", "a block's tokens nearly identical"),
    Diagnosis("edge_of_stability", "Edge of stability", "sharpness well past the optimizer's edge"),
    Diagnosis("jacobian_explosion", "Signal explosion", "a block's Jacobian norm running away"),
    Diagnosis("weight_runaway", "Weight runaway", "a weight's σ₁ running away"),
    Diagnosis("non_finite", "Non-finite values", "NaN or inf in what the monitor saw"),
)
"""The default alert rules as diagnoses, in the order ``spectral-monitor report`` gives its verdicts."""


def _alert_rules() -> ModuleType:
    # Imported when a threshold is read, not with the catalogue: the rules validate their metric names
    # against this catalogue, so they load after it.
    from spectral_monitor.alerts import rules

    return rules
