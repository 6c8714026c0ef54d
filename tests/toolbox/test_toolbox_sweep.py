"""Rank-collapse sweep, the random-attention baselines it is read against, and length-aware attention."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch

from spectral_monitor.cli import main
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.metrics.baselines import iid_logit_spectral_gap, random_attention_sigma2
from spectral_monitor.toolbox import LengthScaledAttention
from spectral_monitor.toolbox.sweep import LOGIT_STD, rank_collapse_sweep, sweep_figure

pytestmark = pytest.mark.usefixtures("one_thread")


def independent_query_key_attention(d_k: int) -> LengthScaledAttention:
    """Two heads of width d_k whose q and k are disjoint halves of the input (swapped in the second head):
    iid N(0, I) query and key rows, independent of each other, for standard-normal inputs."""
    module = LengthScaledAttention(2 * d_k, 2, causal=False)
    with torch.no_grad():
        module.qkv.weight.zero_()
        module.qkv.bias.zero_()
        eye = torch.eye(d_k)
        first, second, keys = slice(0, d_k), slice(d_k, 2 * d_k), 2 * d_k
        module.qkv.weight[first, first] = eye  # head 0: q = x[:d_k]
        module.qkv.weight[keys : keys + d_k, second] = eye  # head 0: k = x[d_k:]
        module.qkv.weight[second, second] = eye  # head 1: q = x[d_k:]
        module.qkv.weight[keys + d_k : keys + 2 * d_k, first] = eye  # head 1: k = x[:d_k]
    return module


def retrieval_head(**scaling) -> LengthScaledAttention:
    """One head of width 64 whose query finds its own key with a fixed logit margin Δ = 5 over the rest.

    With q = k = c·x and |x|² = 64, the self logit is c²·64/√64 = 5 at the standard scale and the others are
    ~N(0, c²): the e^Δ/(e^Δ + n − 1) regime in which plain softmax flattens as n grows.
    """
    module = LengthScaledAttention(64, 1, causal=False, **scaling)
    with torch.no_grad():
        module.qkv.bias.zero_()
        c = math.sqrt(5 / 8)
        eye = torch.eye(64)
        module.qkv.weight.copy_(torch.cat([c * eye, c * eye, eye]))
    return module


@pytest.mark.slow
@pytest.mark.parametrize(("n", "d_k"), [(512, 16), (1024, 16), (2048, 32)])
def test_sigma2_of_random_query_key_attention_follows_the_law(n, d_k):
    result = rank_collapse_sweep(independent_query_key_attention(d_k), [n], num_sequences=2)
    logit_std = result.value(n, "model", LOGIT_STD)
    assert logit_std == pytest.approx(1.0, rel=0.05)  # unit-variance q, k rows at scale 1/√d_k
    law = random_attention_sigma2(n, d_k, logit_std)
    assert result.value(n, "model", "sigma2") == pytest.approx(law, rel=0.15)


@pytest.mark.slow
def test_iid_logit_gap_approaches_one_as_the_law_says():
    generator = torch.Generator().manual_seed(0)
    n = 2048
    attention = torch.softmax(torch.randn(1, n, n, generator=generator), dim=-1)
    sigma = torch.linalg.svdvals(attention)[0]
    measured_gap = 1 - float(sigma[1] / sigma[0])
    assert 1 - measured_gap == pytest.approx(1 - iid_logit_spectral_gap(n), rel=0.15)


def test_log_n_scaling_keeps_a_retrieval_head_flat_where_plain_softmax_collapses():
    lengths = [64, 256, 1024]
    plain = rank_collapse_sweep(retrieval_head(), lengths)
    scaled = rank_collapse_sweep(retrieval_head(logit_scaling="log_n", train_seq_len=64), lengths)

    # Identical at the training length: the relative form is the standard scale there.
    for metric in ("entropy", "self_attention", "sigma2"):
        assert plain.value(64, "model", metric) == pytest.approx(scaled.value(64, "model", metric), rel=1e-5)

    # Plain: the self weight e^5/(e^5 + n − 1) drains away and rows drift toward the uniform (rank-one) row.
    plain_self = plain.series("model", "self_attention")
    plain_entropy = plain.series("model", "entropy")
    assert plain_self[-1] < 0.3 * plain_self[0]
    assert plain_entropy[-1] - plain_entropy[0] > 0.3

    # γ·log n / log n_train: the margin grows with log n and the same metrics stay put.
    scaled_self = scaled.series("model", "self_attention")
    scaled_entropy = scaled.series("model", "entropy")
    assert max(scaled_self) - min(scaled_self) < 0.1 * scaled_self[0]
    assert max(scaled_entropy) - min(scaled_entropy) < 0.1


def test_sweep_of_the_demo_model_measures_every_layer_and_leaves_the_model_as_found():
    model = DemoTransformer(seq_len=128, n_layers=2, causal=False).train()
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)

    result = rank_collapse_sweep(model, [32, 128], num_sequences=2)

    assert torch.equal(torch.rand(3), expected_draw)  # global RNG untouched
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(p, parameters[name]) for name, p in model.named_parameters())
    assert result.layers("attention") == ["blocks.0.attention", "blocks.1.attention"]
    assert result.layers("tokens") == ["blocks.0", "blocks.1"]
    assert result.head_dims == {"blocks.0.attention": 16, "blocks.1.attention": 16}
    for n in (32, 128):
        assert 0 < result.value(n, "blocks.1.attention", "spectral_gap") <= 1
        assert -1 <= result.value(n, "blocks.0", "cosine_similarity", family="tokens") <= 1
    figure = sweep_figure(result)
    assert len(figure.axes) == 5
    assert "| attention | spectral_gap | blocks.0.attention |" in result.to_markdown()


def test_user_inputs_are_cut_to_each_length():
    model = DemoTransformer(seq_len=64, n_layers=1, causal=True)
    tokens = torch.randint(0, 160, (2, 64), generator=torch.Generator().manual_seed(0))
    result = rank_collapse_sweep(model, [16, 64], inputs=tokens)
    assert result.masked == {"blocks.0.attention": True}
    assert not math.isnan(result.value(16, "blocks.0.attention", "entropy"))
    with pytest.raises(ValueError, match="inputs"):
        rank_collapse_sweep(model, [128], inputs=tokens)


@pytest.mark.parametrize(
    ("lengths", "match"), [([], "lengths"), ([1, 8], "lengths"), ("64", "lengths"), ([8.0], "lengths")]
)
def test_bad_lengths_are_refused(lengths, match):
    with pytest.raises(ValueError, match=match):
        rank_collapse_sweep(retrieval_head(), lengths)


def test_a_model_without_attention_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no attention was captured"):
        rank_collapse_sweep(torch.nn.Linear(4, 4), [8])


def test_cli_sweep_writes_the_table_and_the_figure(tmp_path, capsys):
    assert main(["sweep", "--config", "demo", "--lengths", "16", "32", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "sweep.md").read_text()
    assert "| attention | spectral_gap | blocks.3.attention |" in table
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert "n=32" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_sweep_loads_a_checkpoint_and_refuses_lengths_beyond_its_positions_or_a_missing_one(tmp_path):
    model = DemoTransformer(seq_len=32, n_layers=1, d_model=32)
    data = SyntheticDataModule(seq_len=32, batch_size=2, num_batches=1, num_pairs=4, num_queries=2)
    trainer = pl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, datamodule=data)
    checkpoint = tmp_path / "model.ckpt"
    trainer.save_checkpoint(checkpoint)

    assert (
        main(["sweep", "--checkpoint", str(checkpoint), "--lengths", "8", "32", "--out", str(tmp_path)]) == 0
    )
    assert "| attention | entropy | blocks.0.attention |" in (tmp_path / "sweep.md").read_text()
    with pytest.raises(SystemExit, match="seq_len=32"):
        main(["sweep", "--checkpoint", str(checkpoint), "--lengths", "64", "--out", str(tmp_path)])
    not_one = tmp_path / "notes.ckpt"
    not_one.write_text("not a checkpoint")
    for path, problem in ((tmp_path / "missing.ckpt", "no such file"), (not_one, "not a DemoTransformer")):
        with pytest.raises(SystemExit) as refused:
            main(["sweep", "--checkpoint", str(path), "--lengths", "8", "--out", str(tmp_path)])
        assert str(refused.value).startswith(f"spectral-monitor sweep: error: --checkpoint {path}: {problem}")
        assert "\n" not in str(refused.value)
