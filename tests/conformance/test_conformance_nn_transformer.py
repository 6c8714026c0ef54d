"""Conformance of ``nn.Transformer`` encoder-decoder (causal target mask, three padding masks, cross-attention
of 5 queries x 6 keys).

Every attention and token metric the monitor logs for a layer equals the float64 reference from each
``nn.MultiheadAttention`` called again with ``need_weights=True``, over real queries x attendable keys (real
tokens), for each padding case; padding never raises an alert.
"""

import pytest
from conformance_harness import assert_conforms, assert_far_from_uniform, assert_no_false_alarm, run_monitored
from conformance_models import nn_transformer_family

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def monitored(one_thread):
    family = nn_transformer_family()
    return family, run_monitored(family)


@pytest.mark.parametrize(
    "case", ["no_padding", "right_padding", "left_padding", "fully_padded_sequence", "single_token_sequence"]
)
def test_nn_transformer_logs_the_reference_metrics(monitored, case):
    family, run = monitored
    assert_conforms(family, run, case)


def test_nn_transformer_padding_raises_no_false_alarm(monitored):
    family, run = monitored
    assert_no_false_alarm(family, run)


def test_nn_transformer_attention_is_far_from_uniform(monitored):
    family, _ = monitored
    assert_far_from_uniform(family)
