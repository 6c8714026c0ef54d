"""Conformance of Hugging Face GPT-2 (``sdpa``).

Every attention and token metric the monitor logs for a layer equals the float64 reference from the eager
twin's ``output_attentions``, over real queries x attendable keys (real tokens), for each padding case;
padding never raises an alert.
"""

import pytest

pytest.importorskip("transformers")

from conformance_harness import assert_conforms, assert_far_from_uniform, assert_no_false_alarm, run_monitored
from conformance_models import gpt2_family

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def monitored(one_thread):
    family = gpt2_family()
    return family, run_monitored(family)


@pytest.mark.parametrize(
    "case", ["no_padding", "right_padding", "left_padding", "fully_padded_sequence", "single_token_sequence"]
)
def test_gpt2_logs_the_reference_metrics(monitored, case):
    family, run = monitored
    assert_conforms(family, run, case)


def test_gpt2_padding_raises_no_false_alarm(monitored):
    family, run = monitored
    assert_no_false_alarm(family, run)


def test_gpt2_attention_is_far_from_uniform(monitored):
    family, _ = monitored
    assert_far_from_uniform(family)
