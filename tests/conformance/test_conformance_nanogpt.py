"""Conformance of a nanoGPT-style model (``F.scaled_dot_product_attention(is_causal=True)``; padding told with
``SpectralMonitor(token_mask=...)``).

Every attention and token metric the monitor logs for a layer equals the float64 reference from q and k
recomputed in float64 from each attention layer's input, over real queries x attendable keys (real tokens),
for each padding case; padding never raises an alert.
"""

import pytest
from conformance_harness import assert_conforms, assert_far_from_uniform, assert_no_false_alarm, run_monitored
from conformance_models import nanogpt_family

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def monitored(one_thread):
    family = nanogpt_family()
    return family, run_monitored(family)


@pytest.mark.parametrize(
    "case", ["no_padding", "right_padding", "fully_padded_sequence", "single_token_sequence"]
)
def test_nanogpt_logs_the_reference_metrics(monitored, case):
    family, run = monitored
    assert_conforms(family, run, case)


def test_nanogpt_padding_raises_no_false_alarm(monitored):
    family, run = monitored
    assert_no_false_alarm(family, run)


def test_nanogpt_attention_is_far_from_uniform(monitored):
    family, _ = monitored
    assert_far_from_uniform(family)
