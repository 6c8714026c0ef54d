"""What a monitor measures, how often and with which limits: :class:`MonitorOptions`, validated when made.

The one definition and documentation of every option. Options that belong together are grouped into option
objects: :class:`CaptureOptions` (what is recorded from the forward), :class:`OutputOptions` (what is
written besides the scalars), :class:`BudgetOptions` (what the attention work may cost), as the opt-in probes'
:class:`~spectral_monitor.core.second_order.CurvatureOptions` are. Every adapter (the Lightning callback, the
Hugging Face callback, the plain-loop :class:`~spectral_monitor.Monitor`) takes either ``options=`` or the
same options as flat keywords (``every_n_steps=10, per_head=True``), which
:meth:`MonitorOptions.from_keywords` maps onto the groups, with the same ``ValueError`` for a name or value
it does not know.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
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
from spectral_monitor.probes.attention_families import AttentionFamilies
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

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "FULL_MEMORY_RATIO",
    "FULL_OVERHEAD_PERCENT",
    "MIN_MEMORY_BUDGET_MB",
    "PRESETS",
    "BudgetOptions",
    "CaptureOptions",
    "MonitorOptions",
    "OutputOptions",
]

FAMILIES = ("attention", "tokens", "weights")
"""What the monitor can observe: attention matrices, residual-stream tokens, weight matrices."""
ALL_FAMILIES = (*FAMILIES, *OPT_IN_FAMILIES)
"""Every family a monitor may measure: the opt-in ones are turned on by their options objects."""

_OPTIONS_CLASSES = {"curvature": CurvatureOptions, "jacobian": JacobianOptions, "ntk": NTKOptions}

MIN_MEMORY_BUDGET_MB = 2**-10
"""The smallest ``memory_budget_mb`` (1 KiB): below it the attention capture has no byte to hold."""

FULL_OVERHEAD_PERCENT = 10.0
"""The ``"full"`` preset's curvature probe: at most this share of training time, amortised."""
FULL_MEMORY_RATIO = 2.0
"""The ``"full"`` preset's curvature probe: at most this many times a training step's peak memory."""


def _full_curvature() -> CurvatureOptions:
    """The ``"full"`` preset's curvature probe, made anew for each monitor (options are mutable)."""
    return CurvatureOptions(max_overhead_percent=FULL_OVERHEAD_PERCENT, max_memory_ratio=FULL_MEMORY_RATIO)


PRESETS: dict[str, dict[str, Any]] = {
    "light": {
        "families": ("attention", "weights"),
        "per_head": False,
        "histograms": False,
        "figures_every_n_logs": 0,
        "head_diversity_every_n_logs": 0,
        "weight_spectra_every_n_logs": 0,
        "curvature": None,
        "attention_cost_ratio": 0.15,
    },
    "standard": {
        "families": FAMILIES,
        "per_head": False,
        "histograms": True,
        "figures_every_n_logs": 10,
        "head_diversity_every_n_logs": 4,
        "weight_spectra_every_n_logs": 0,
        "curvature": None,
        "attention_cost_ratio": 0.3,
    },
    "full": {
        "families": FAMILIES,
        "per_head": True,
        "histograms": True,
        "figures_every_n_logs": 10,
        "head_diversity_every_n_logs": 1,
        "weight_spectra_every_n_logs": 10,
        "curvature": _full_curvature,
        "attention_cost_ratio": math.inf,
    },
}
"""What each ``preset`` sets, for the options left at None (:class:`OutputOptions`' fields, ``families``,
``curvature`` and ``attention_cost_ratio``): ``"light"``, the attention and weight
scalars alone (no tokens, histograms, figures or head diversity), with a tighter attention cost budget;
``"standard"``, the defaults; ``"full"``, per-head scalars, head diversity on every logging step, weight
spectra every 10th, every head measured on every logging step (no attention cost budget), and the
loss-Hessian probe with :class:`CurvatureOptions`' defaults but a cadence stretched to keep it under 10% of
training time and a refusal, before its first event, when its memory would exceed twice a training step's."""


@dataclass
class CaptureOptions:
    """What the monitor records from the training forward on a logging step.

    Attributes:
        include: ``fnmatch`` patterns over qualified module names: an attention module, a block or a weight's
            module is measured if its name matches one (``"blocks.0*"``: the first block and everything in
            it). None: everything.
        exclude: patterns of module names not to measure; applied after ``include``.
        max_sequences: sequences of the batch captured (the first ones: no random numbers drawn).
        token_mask: a function of the training batch returning its (batch, tokens) token mask, True (or
            nonzero) = real token, or None. Needed only where the model's forward does not say which tokens
            are padding: a Hugging Face ``attention_mask`` and ``nn.Transformer``'s ``src_key_padding_mask``
            / ``tgt_key_padding_mask`` are read from the forward itself. Padded queries leave the attention
            metrics of every layer with that many queries, and padded tokens the token metrics.
        attention_families: what this monitor knows of attention-module families
            (:class:`~spectral_monitor.probes.AttentionFamilies`): the class names that look like attention,
            the attributes holding head counts and widths, the keywords of padding masks and the layouts of
            fused q/k/v projections, read by the weight probe, the preflight, the token masks and the advice
            when no attention is seen. None: ``AttentionFamilies()``, the default as of when the options are
            made (with the layouts registered by :func:`~spectral_monitor.probes.register_qkv_layout` by
            then). In YAML a mapping of its fields, e.g. ``qkv_layouts: {FalconAttention: {projection:
            query_key_value, layout: concatenated}}``.
        block_patterns: ``fnmatch`` patterns over qualified module names naming the transformer blocks whose
            outputs are the residual stream the token metrics measure (``["encoder.stack.*"]``). None: found
            automatically (:func:`~spectral_monitor.probes.find_transformer_blocks`).

    Raises:
        ValueError: if a field is out of range (the message names it).

    Examples:
        >>> CaptureOptions(include=["blocks.0*"], max_sequences=1).max_sequences
        1
    """

    include: Sequence[str] | None = None
    exclude: Sequence[str] | None = None
    max_sequences: int = 2
    token_mask: Callable[[Any], Tensor | None] | None = None
    attention_families: AttentionFamilies | None = None
    block_patterns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        self.include = check_patterns("include", self.include)
        self.exclude = check_patterns("exclude", self.exclude)
        self.block_patterns = check_patterns("block_patterns", self.block_patterns)
        check_int("max_sequences", self.max_sequences, smallest=1)
        check_callable("token_mask", self.token_mask, "a function of the batch returning its token mask")
        self.attention_families = check_instance(
            "attention_families", self.attention_families, AttentionFamilies
        )


@dataclass
class OutputOptions:
    """What the monitor writes besides each layer's scalars. A field left at None takes the ``preset``'s
    value (:data:`PRESETS`) when the :class:`MonitorOptions` holding it is made.

    Attributes:
        per_head: also write each head's values as scalars: attention metrics, and the weight metrics of
            each head's rows of W_Q, W_K, W_V with their histograms. Off by default: the alert rules read
            every head either way, and the attention histograms and layer × head images show them. None:
            the preset's (on only in ``"full"``).
        histograms: write histograms of per-head values and of weight singular values. None: the preset's
            (off only in ``"light"``).
        figures_every_n_logs: on every k-th logging step, starting with the first, draw the figures (the
            singular values of the drawn head of each layer, the attention of that head in the first and
            last layer, a layer × head map of each metric in ``HEATMAP_METRICS``) and write histograms of
            each weight's singular values (a full eigendecomposition of each weight's Gram matrix); 0:
            never; None: the preset's (0 in ``"light"``, else 10). TensorBoard shows 10 images per tag
            unless started with ``--samples_per_plugin images=N``. The figures are kept and redrawn
            (``spectral_monitor.sinks.redrawn.RedrawnFigure``), so a later figure step costs less than the
            first.
        head_diversity_every_n_logs: on every k-th logging step, starting with the first, write
            ``attention/head_diversity/<layer>`` (mean Jensen–Shannon distance between the heads' normalised
            attention spectra, :mod:`spectral_monitor.metrics.heads`), ``head_diversity_min`` (the closest
            pair) and a text entry ``attention/redundant_heads`` listing each layer's closest head pairs
            (one ``svdvals`` per sampled head); 0: never; None: the preset's (0 in ``"light"``, 4 in
            ``"standard"``, 1 in ``"full"``).
        weight_spectra_every_n_logs: on every k-th logging step, starting with the first, every singular
            value of every weight (one decomposition with the histograms where both are due):
            ``weights/<metric>/<weight>`` for ``mp_edge``, ``mp_spikes``, ``alpha`` (power-law tail
            exponent of σ², WeightWatcher's convention), ``alpha_ks_distance``, ``energy_rank_90`` and
            ``energy_rank_99`` (compressible rank), and ESD-against-Marchenko–Pastur figures
            ``weights/figures/esd/<weight>``, with the "weights" family on; 0: never; None: the preset's (10
            in ``"full"``, else 0).
        output_logits: also write ``outputs/max_logit/model`` (the largest output logit over the sampled
            sequences' real tokens) and ``outputs/log_partition/model`` (the mean over them of the
            log-sum-exp over the vocabulary, the z-loss quantity), from a forward hook on the LM head on
            logging steps. True: the head is ``get_output_embeddings()`` of a Hugging Face model, else the
            last ``nn.Linear`` with as many outputs as the first ``nn.Embedding`` has rows; a string names
            the head module. False (default): off.

    Raises:
        ValueError: if a field is out of range (the message names it).

    Examples:
        >>> OutputOptions(per_head=True, figures_every_n_logs=0).per_head
        True
    """

    per_head: bool | None = None
    histograms: bool | None = None
    figures_every_n_logs: int | None = None
    head_diversity_every_n_logs: int | None = None
    weight_spectra_every_n_logs: int | None = None
    output_logits: bool | str = False

    def __post_init__(self) -> None:
        for name in ("per_head", "histograms"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        for name in ("figures_every_n_logs", "head_diversity_every_n_logs", "weight_spectra_every_n_logs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), smallest=0)
        if not isinstance(self.output_logits, (bool, str)) or self.output_logits == "":
            raise ValueError(
                "output_logits must be True, False or the name of the LM head module, "
                f"got {self.output_logits!r}"
            )


@dataclass
class BudgetOptions:
    """What a logging step's attention work may cost, and how it is computed.

    Attributes:
        memory_budget_mb: most memory (MiB: 2²⁰ bytes; at least 1/1024) a logging step's attention work
            adds at its peak: the q and k the capture holds from the forward, the probabilities formed from
            them, the metrics' working memory, the singular values for head diversity and the figures, and
            the drawn attention. Over it the capture keeps fewer sequences, then heads, then layers, with a
            warning, so that each layer's probabilities fit whole. Each layer is then measured a chunk of
            its matrices at a time, as many as fit what the capture leaves with their working memory (about
            8.5 times a float32 matrix on the exact path, 2.3–3.8 on the Krylov path); where not even one
            fits, or from ``BLOCKWISE_MIN_TOKENS`` (4096) tokens, from q and k in blocks within it
            (``attention_metrics_from_qk``, on the Krylov path where the exact one was asked for, with a
            warning), and the layer is left out of the figures and head diversity. Singular values are
            taken in float64 where that fits, else in float32 (σ within ~1e-7 σ₁), else the layer is left
            out of them with a warning. The heatmaps keep block means of at most 128 × 128. Not covered:
            the model's own forward and backward, the other families (tokens, weights and the opt-in
            probes), the figures' canvases kept between figure steps and their PNG encoding, and memory
            the allocator keeps after it is freed (``benchmarks/README.md`` has measured figures).
        metric_method: ``method`` of ``attention_metrics``: ``"auto"``, ``"exact"`` or ``"krylov"``.
        attention_rank_sums: measure the attention's effective and threshold ranks, the members that need
            the whole spectrum. On the Krylov path (long sequences) their quadrature is most of the time
            (``benchmarks/README.md``). False leaves them (and the effective-rank figure) out.
        attention_cost_ratio: most each layer's attention measurement may cost, as a multiple of that
            layer's training work on the sampled sequences (its attention and a standard block's linear
            layers, forward and backward), by the cost model of
            :mod:`spectral_monitor.core.attention_budget`. Over it a logging step measures fewer heads (all
            the sampled sequences of each), a different set each step so that every head is measured within
            ⌈H/k⌉ logging steps; at least one head of one sequence; and where even one matrix is over it
            on the Krylov path, without the rank sums, unless that matrix alone costs at most the layer's
            training work; off the exact path, a layer whose head diversity
            (a factorisation of each matrix measured) would exceed it is left out of head diversity. The
            layer's ``heads_measured`` is then written, the per-layer means are over the heads measured,
            and each has a ``<metric>_head_se``, the standard error of that mean as an estimate of the mean
            over every head. ``math.inf``: every head always.
            None: the preset's (0.15 in ``"light"``, 0.3 in ``"standard"``, ``math.inf`` in ``"full"``).

    Raises:
        ValueError: if a field is out of range (the message names it).

    Examples:
        >>> BudgetOptions(memory_budget_mb=64).memory_budget_mb
        64.0
    """

    memory_budget_mb: float = 256.0
    metric_method: str = "auto"
    attention_rank_sums: bool = True
    attention_cost_ratio: float | None = None

    def __post_init__(self) -> None:
        self.memory_budget_mb = check_number(
            "memory_budget_mb",
            self.memory_budget_mb,
            at_least=MIN_MEMORY_BUDGET_MB,
            unit="positive number of megabytes",
        )
        check_choice("metric_method", self.metric_method, METRIC_METHODS)
        check_bool("attention_rank_sums", self.attention_rank_sums)
        if self.attention_cost_ratio is not None and self.attention_cost_ratio != math.inf:
            self.attention_cost_ratio = check_number(
                "attention_cost_ratio",
                self.attention_cost_ratio,
                above=0,
                unit="positive number (or math.inf: no attention cost budget)",
            )


_GROUPS = {"capture": CaptureOptions, "outputs": OutputOptions, "budget": BudgetOptions}


@dataclass
class MonitorOptions:
    """The monitor's options: what it measures, how often and with which limits, made valid or not at all.

    Every adapter takes them whole (``SpectralMonitor(options=MonitorOptions(...))``) or as flat keywords
    (``SpectralMonitor(every_n_steps=10, per_head=True)``, :meth:`from_keywords`): a keyword names a field
    below or a field of one of the groups (``capture``, ``outputs``, ``budget``).

    Attributes:
        every_n_steps: measure when ``(step + 1) % every_n_steps == 0``, Lightning's own
            ``log_every_n_steps`` rule, so with equal values both land on the same steps.
        families: which of :data:`FAMILIES` (``"attention"``, ``"tokens"``, ``"weights"``) to measure
            (empty: none of them, where an opt-in probe's options are given). None: the preset's (standard:
            all three). The opt-in ``"curvature"``, ``"jacobian"`` and ``"ntk"`` are turned on by their
            options objects alone (``curvature=CurvatureOptions()``), and ``families`` then ends up naming
            them too; naming one here is refused.
        capture: what is recorded from the forward (:class:`CaptureOptions`).
        outputs: what is written besides the scalars (:class:`OutputOptions`).
        budget: what the attention work may cost (:class:`BudgetOptions`).
        strict: raise failures of the monitor (a probe or sink raising, non-finite measurements) instead of
            warning once per kind and going on without them.
        log_first_step: also measure step 0, the model before any update.
        curvature: options of the loss-Hessian probe (:class:`CurvatureOptions`); giving them turns it on.
            None: the preset's (in ``"full"``, ``CurvatureOptions(max_overhead_percent=10,
            max_memory_ratio=2)``, else off).
        jacobian: options of the block-Jacobian probe (:class:`JacobianOptions`); giving them turns it on.
            None: off (an opt-in probe that is off stays None, so a copy of the options leaves it off).
        ntk: options of the empirical-NTK probe (:class:`NTKOptions`); giving them turns it on.
        probe_data: the batch and loss those three probes use (:class:`ProbeDataOptions`).
        preflight: at the start of training, run
            :func:`spectral_monitor.toolbox.preflight.architecture_preflight` once: warnings on the console,
            every finding in the text entry ``preflight``.
        preflight_context_length: context length of the preflight's logit-scale check (None: the model's
            ``hparams.seq_len`` if it has one, else the check is skipped).
        alerts: which alert rules run: None for :func:`~spectral_monitor.alerts.default_rules`, or an
            :class:`~spectral_monitor.alerts.AlertConfig` that disables, tunes or adds rules.
        on_alert: called on the writing process with each :class:`~spectral_monitor.alerts.AlertEvent`,
            fired and resolved (``event.kind``), after its console line.
        stop_on: names of rules whose firing stops training: every rank stops after the same step. Checked
            against the rules that run when a :class:`~spectral_monitor.core.MonitorSession` is made.
        preset: what the options left at None default to (:data:`PRESETS`): ``"light"`` (attention and
            weight scalars: no tokens, histograms, figures or head diversity), ``"standard"`` (the
            defaults), or ``"full"`` (also per-head scalars, head diversity on every logging step, weight
            spectra every 10th and the loss-Hessian probe). An option given explicitly overrides it.

    Raises:
        ValueError: if an option is out of range (the message names it).

    Examples:
        >>> options = MonitorOptions(every_n_steps=10, outputs=OutputOptions(per_head=True))
        >>> options.outputs.per_head, options.outputs.histograms, options.families
        (True, True, ('attention', 'tokens', 'weights'))
        >>> MonitorOptions.from_keywords(every_n_steps=10, per_head=True) == options
        True
    """

    every_n_steps: int = 50
    families: Sequence[str] | None = None
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    outputs: OutputOptions = field(default_factory=OutputOptions)
    budget: BudgetOptions = field(default_factory=BudgetOptions)
    strict: bool = False
    log_first_step: bool = True
    curvature: CurvatureOptions | None = None
    jacobian: JacobianOptions | None = None
    ntk: NTKOptions | None = None
    probe_data: ProbeDataOptions | None = None
    preflight: bool = True
    preflight_context_length: int | None = None
    alerts: AlertConfig | None = None
    on_alert: Callable[[AlertEvent], Any] | None = None
    stop_on: Sequence[str] = ()
    preset: str = "standard"

    @classmethod
    def from_keywords(cls, **keywords: Any) -> MonitorOptions:
        """The options given as flat keywords, each a field of the options or of one of their groups.

        ``MonitorOptions.from_keywords(every_n_steps=10, max_sequences=1, per_head=True)`` is
        ``MonitorOptions(every_n_steps=10, capture=CaptureOptions(max_sequences=1),
        outputs=OutputOptions(per_head=True))``. A group may also be given whole (``capture=...``), but not
        together with keywords of its own fields.

        Args:
            **keywords: option names (:func:`keyword_names`) and their values.

        Returns:
            The validated options.

        Raises:
            ValueError: if a keyword is not an option (the message lists those there are), or a value is
                out of range (the message names it).
        """
        grouped = grouped_keywords(keywords)
        for name in keywords:
            group = KEYWORD_GROUPS[name]
            if group is not None and isinstance(grouped[group], Mapping):
                grouped[group] = _GROUPS[group](**grouped[group])
        return cls(**grouped)

    def keyword_value(self, name: str) -> Any:
        """The value of the option a flat keyword names (``"max_sequences"``: ``capture.max_sequences``).

        Args:
            name: one of :func:`keyword_names`.

        Returns:
            The option's validated value.

        Raises:
            ValueError: if ``name`` is not an option.
        """
        check_keywords({name: None})
        group = KEYWORD_GROUPS[name]
        return getattr(self if group is None else getattr(self, group), name)

    def __post_init__(self) -> None:
        check_choice("preset", self.preset, tuple(PRESETS))
        for group, kind in _GROUPS.items():
            setattr(self, group, check_instance(group, getattr(self, group), kind))
        # The preset fills a copy: a group given by the caller may be shared with other monitors.
        for group in ("outputs", "budget"):
            unset = {
                name: value
                for name, value in PRESETS[self.preset].items()
                if KEYWORD_GROUPS[name] == group and getattr(getattr(self, group), name) is None
            }
            setattr(self, group, replace(getattr(self, group), **unset))
        for name in ("families", "curvature"):
            if getattr(self, name) is None:
                value = PRESETS[self.preset][name]
                setattr(self, name, value() if callable(value) else value)
        check_int("every_n_steps", self.every_n_steps, smallest=1)
        given = {"curvature": self.curvature, "jacobian": self.jacobian, "ntk": self.ntk}
        named = list(self.families) if isinstance(self.families, (list, tuple)) else self.families
        if isinstance(named, list):
            # An opt-in family is named in the families of options already made (a copy of them), with its
            # options; named alone, it is refused.
            unset = [name for name in named if name in OPT_IN_FAMILIES and given[name] is None]
            if unset:
                name = unset[0]
                raise ValueError(
                    f"families names the opt-in family {name!r}; families are drawn from {list(FAMILIES)}, "
                    f"and {name} is turned on by its options: {name}={_OPTIONS_CLASSES[name].__name__}(...)"
                )
            named = [name for name in named if name not in OPT_IN_FAMILIES]
        families = tuple(dict.fromkeys(check_names("families", named, allowed=FAMILIES)))
        check_bool("strict", self.strict)
        check_bool("log_first_step", self.log_first_step)
        self.families = families + tuple(name for name, value in given.items() if value is not None)
        if not self.families:
            raise ValueError(
                f"families must name at least one of {list(FAMILIES)} unless an opt-in probe's options are "
                "given (curvature=, jacobian= or ntk=)"
            )
        # An opt-in probe that is off stays None, so that a copy (dataclasses.replace) leaves it off.
        for name, value in given.items():
            if value is not None:
                setattr(self, name, check_instance(name, value, _OPTIONS_CLASSES[name]))
        self.probe_data = check_instance("probe_data", self.probe_data, ProbeDataOptions)
        check_bool("preflight", self.preflight)
        if self.preflight_context_length is not None:
            check_int("preflight_context_length", self.preflight_context_length, smallest=2)


KEYWORD_GROUPS: dict[str, str | None] = {
    **{item.name: None for item in fields(MonitorOptions)},
    **{item.name: group for group, kind in _GROUPS.items() for item in fields(kind)},
}
"""Every flat keyword an adapter takes, and the group whose field it names (None: a field of
:class:`MonitorOptions` itself)."""


def keyword_names() -> list[str]:
    """The flat keywords the adapters take: the fields of :class:`MonitorOptions` and of its groups.

    Returns:
        The names, in the order they are defined.
    """
    return list(KEYWORD_GROUPS)


def grouped_keywords(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Flat keywords in the shape of :class:`MonitorOptions`: a group's fields gathered under its name, the
    shape a LightningCLI config gives under ``options:``.

    Args:
        keywords: option names (:func:`keyword_names`) and their values.

    Returns:
        The fields of :class:`MonitorOptions`, each group as a mapping of its given fields.

    Raises:
        ValueError: if a keyword is not an option, or a group is given both whole and by its fields.

    Examples:
        >>> grouped_keywords({"every_n_steps": 10, "max_sequences": 1, "per_head": True})
        {'every_n_steps': 10, 'capture': {'max_sequences': 1}, 'outputs': {'per_head': True}}
    """
    check_keywords(keywords)
    grouped = {name: value for name, value in keywords.items() if KEYWORD_GROUPS[name] is None}
    for group in _GROUPS:
        given = {name: value for name, value in keywords.items() if KEYWORD_GROUPS[name] == group}
        if given and group in grouped:
            raise ValueError(
                f"{group} is given whole and {', '.join(sorted(given))} of it as keywords: "
                "give one or the other"
            )
        if given:
            grouped[group] = given
    return grouped


def options_of(options: MonitorOptions | None, keywords: Mapping[str, Any], *, owner: str) -> MonitorOptions:
    """The options an adapter was given: ``options`` whole, or flat ``keywords``, not both.

    Args:
        options: the options given whole, or None.
        keywords: flat keywords (:meth:`MonitorOptions.from_keywords`).
        owner: the adapter, named in the messages.

    Returns:
        The validated options.

    Raises:
        ValueError: if both are given, ``options`` is not a :class:`MonitorOptions`, or a keyword is unknown
            or its value out of range.
    """
    check_keywords(keywords, owner=owner)
    if options is None:
        return MonitorOptions.from_keywords(**keywords)
    if not isinstance(options, MonitorOptions):
        raise ValueError(
            f"options must be a MonitorOptions or None, got {type(options).__name__} {options!r}"
        )
    if keywords:
        raise ValueError(
            f"options is given whole and {', '.join(sorted(keywords))} as keywords: give one or the other"
        )
    return options


def check_keywords(keywords: Mapping[str, Any], *, owner: str = "MonitorOptions") -> None:
    """Refuse a keyword that names no option.

    Args:
        keywords: the keywords an adapter was given.
        owner: what was given them, named in the message (``"SpectralMonitor"``).

    Raises:
        ValueError: naming the unknown keywords, the nearest option names and every option there is.

    Examples:
        >>> try:
        ...     check_keywords({"every_n_step": 10}, owner="Monitor")
        ... except ValueError as error:
        ...     print(str(error).split(";")[0])
        every_n_step is not an option of Monitor (did you mean every_n_steps?)
    """
    unknown = sorted(set(keywords) - set(KEYWORD_GROUPS))
    if unknown:
        close = [n for name in unknown for n in difflib.get_close_matches(name, KEYWORD_GROUPS, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"{', '.join(unknown)} {'is not an option' if len(unknown) == 1 else 'are not options'} of "
            f"{owner}{hint}; the options are options (a MonitorOptions) or, as keywords, "
            f"{', '.join(KEYWORD_GROUPS)}"
        )
