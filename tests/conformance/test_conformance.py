"""Conformance on eight model families written outside this project, each with the padding its users have.

For each family and padding case, every attention and token metric the monitor logs for a layer equals the
float64 reference from an independent source, over real queries x attendable keys (real tokens); padding
never raises an alert; and the family's attention is far from uniform, so the check can tell definitions
apart. The sources: a Hugging Face model's eager twin with ``output_attentions`` (GPT-2; Llama with grouped
KV heads and rotary embeddings; BERT; T5, whose relative position bias arrives as a float mask, with encoder,
causal decoder and cross-attention of 5 queries x 6 keys; ViT, non-causal and unpadded); each
``nn.MultiheadAttention`` of an ``nn.Transformer`` encoder-decoder called again with ``need_weights=True``;
q and k of a nanoGPT-style model (``F.scaled_dot_product_attention(is_causal=True)``, padding told with
``SpectralMonitor(token_mask=...)``) recomputed in float64 from each layer's input; and the probabilities
of attention written by hand, seen through a registered extractor. A family is built and monitored once,
for all its tests.
"""

import functools
import importlib.util

import pytest
from conformance_harness import (
    Family,
    MonitoredRun,
    assert_conforms,
    assert_far_from_uniform,
    assert_no_false_alarm,
    run_monitored,
)
from conformance_models import (
    bert_family,
    extractor_family,
    gpt2_family,
    llama_family,
    mistral_family,
    nanogpt_family,
    nn_transformer_family,
    t5_family,
    vit_family,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EVERY_CASE = ("no_padding", "right_padding", "left_padding", "fully_padded_sequence", "single_token_sequence")
NO_LEFT_PADDING = ("no_padding", "right_padding", "fully_padded_sequence", "single_token_sequence")
FAMILIES = {
    # name: (builder, padding cases, built with Hugging Face transformers)
    "gpt2": (gpt2_family, EVERY_CASE, True),
    "llama": (llama_family, EVERY_CASE, True),
    "mistral": (mistral_family, EVERY_CASE, True),
    "bert": (bert_family, NO_LEFT_PADDING, True),
    "t5": (t5_family, NO_LEFT_PADDING, True),
    "vit": (vit_family, ("no_padding",), True),
    "nn_transformer": (nn_transformer_family, EVERY_CASE, False),
    "nanogpt": (nanogpt_family, NO_LEFT_PADDING, False),
    "extractor": (extractor_family, EVERY_CASE, False),
}
WITHOUT_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="could not import 'transformers'"
)


def _marks(name: str) -> list[pytest.MarkDecorator]:
    return [WITHOUT_TRANSFORMERS] if FAMILIES[name][2] else []


FAMILY_PARAMS = [pytest.param(name, marks=_marks(name), id=name) for name in FAMILIES]
CASE_PARAMS = [
    pytest.param(name, case, marks=_marks(name), id=f"{name}-{case}")
    for name, (_, cases, _) in FAMILIES.items()
    for case in cases
]


@functools.cache
def monitored(name: str) -> tuple[Family, MonitoredRun]:
    """The family built and run under the monitor, once for all its tests (the runs are tiny)."""
    family = FAMILIES[name][0]()
    return family, run_monitored(family)


@pytest.mark.parametrize(("name", "case"), CASE_PARAMS)
def test_the_monitor_logs_the_reference_metrics(name, case):
    family, run = monitored(name)
    assert_conforms(family, run, case)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_padding_raises_no_false_alarm(name):
    family, run = monitored(name)
    assert_no_false_alarm(family, run)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_attention_is_far_from_uniform(name):
    family, _ = monitored(name)
    assert_far_from_uniform(family)
