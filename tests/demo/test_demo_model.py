"""The demo model, task and configs: the model learns, the data are the seed's, the logit scale is exact."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from pytorch_lightning.cli import LightningCLI
from torch.overrides import TorchFunctionMode

from spectral_monitor.demo import (
    DemoTransformer,
    LengthScaledAttention,
    SyntheticDataModule,
    attention_logit_scale,
)
from spectral_monitor.demo.model import IGNORE_INDEX

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TASK = dict(vocab_size=160, num_keys=16, num_values=8, num_pairs=8, num_queries=4)


class RecordSDPACalls(TorchFunctionMode):
    """Records the keyword arguments of each ``scaled_dot_product_attention`` call, as a monitor sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append({"n_keys": args[1].shape[-2], **kwargs})
        return func(*args, **kwargs)


class RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow
def test_training_on_recall_drops_loss_below_the_no_lookup_floor(one_thread):
    """From log(vocab) to well below log(num_values): the model learns the keys *and* attends to the pairs."""
    task = dict(TASK, num_pairs=4, num_queries=4)
    model = DemoTransformer(vocab_size=task["vocab_size"], seq_len=24, lr=3e-3, seed=0)
    data = SyntheticDataModule(seq_len=24, batch_size=32, num_batches=150, seed=0, **task)
    losses = RecordLosses()
    trainer = pl.Trainer(
        max_steps=150,
        accelerator="cpu",
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)

    first, last = sum(losses.losses[:10]) / 10, sum(losses.losses[-10:]) / 10
    assert first > math.log(task["vocab_size"]) - 1, first  # ≈ 4.6 over steps 0-9 (seeds 0-3)
    # Without looking back the best possible loss is log(num_values) ≈ 2.08; measured ≈ 0.055 (seeds 0-3).
    assert last < math.log(task["num_values"]) / 4, last


def test_batches_are_a_function_of_seed_and_index_only():
    rng_before = torch.random.get_rng_state()
    loaded = list(SyntheticDataModule(seed=3, num_batches=3, **TASK).train_dataloader())
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # no global RNG drawn

    torch.manual_seed(1234)  # another global stream, and batches read in another order: same data
    again = SyntheticDataModule(seed=3, num_batches=3, **TASK).train_batches
    for index in (2, 0, 1):
        tokens, targets = again[index]
        assert torch.equal(tokens, loaded[index][0]) and torch.equal(targets, loaded[index][1])

    assert not torch.equal(loaded[0][0], loaded[1][0])
    assert not torch.equal(SyntheticDataModule(seed=4, **TASK).train_batches[0][0], loaded[0][0])


def test_each_query_is_answered_by_the_pair_holding_its_key():
    tokens, targets = SyntheticDataModule(seq_len=48, batch_size=16, seed=0, **TASK).train_batches[0]
    num_keys, num_values, num_queries = TASK["num_keys"], TASK["num_values"], TASK["num_queries"]
    first_filler = num_keys * (1 + num_values)
    assert tokens.shape == targets.shape == (16, 48)
    assert (targets[:, :-num_queries] == IGNORE_INDEX).all()
    for sequence, answers in zip(tokens, targets, strict=True):
        context, queries = sequence[:-num_queries], sequence[-num_queries:]
        pairs = context[(context >= num_keys) & (context < first_filler)]
        assert len(pairs) == TASK["num_pairs"]
        pair_keys = (pairs - num_keys) // num_values
        assert len(set(pair_keys.tolist())) == len(pair_keys)  # one binding per key: no ambiguity
        for query, answer in zip(queries.tolist(), answers[-num_queries:].tolist(), strict=True):
            assert query < num_keys
            assert answer == pairs[pair_keys == query].item()


def test_model_initialisation_depends_on_its_seed_alone_and_leaves_the_global_rng():
    torch.manual_seed(0)
    rng_before = torch.random.get_rng_state()
    a = DemoTransformer(seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    torch.manual_seed(99)
    b = DemoTransformer(seed=7)
    c = DemoTransformer(seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attention.qkv.weight, c.blocks[0].attention.qkv.weight)


@pytest.mark.parametrize(
    ("scaling", "gamma", "train_seq_len", "n", "expected"),
    [
        ("standard", None, None, 50, 1 / math.sqrt(16)),
        ("log_n", None, None, 50, math.log(50) / math.sqrt(16)),
        ("log_n", 0.7, None, 50, 0.7 * math.log(50) / math.sqrt(16)),
        ("log_n", 0.7, 20, 50, 0.7 * math.log(50) / math.log(20) / math.sqrt(16)),
        ("log_n", 0.7, 50, 50, 0.7 / math.sqrt(16)),  # the relative form is γ/√d_k at the training length
    ],
)
def test_scale_passed_to_sdpa_is_the_closed_form(scaling, gamma, train_seq_len, n, expected):
    model = DemoTransformer(
        n_layers=2,
        d_model=64,
        n_heads=4,
        seq_len=64,
        logit_scaling=scaling,
        log_n_gamma=gamma,
        train_seq_len=train_seq_len,
    )
    with RecordSDPACalls() as recorded:
        model(torch.zeros(2, n, dtype=torch.long))

    assert [call["n_keys"] for call in recorded.calls] == [n, n]
    for call in recorded.calls:
        assert call["scale"] == pytest.approx(expected, rel=1e-12)
    assert attention_logit_scale(16, n, scaling, gamma, train_seq_len) == pytest.approx(expected, rel=1e-12)


def test_length_scaled_attention_equals_softmax_of_scaled_logits():
    torch.manual_seed(0)
    attention = LengthScaledAttention(
        d_model=32, n_heads=2, causal=True, logit_scaling="log_n", log_n_gamma=0.5
    )
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    attention.double()
    q, k, v = attention.qkv(x).view(3, 10, 3, 2, 16).permute(2, 0, 3, 1, 4)
    logits = (q @ k.transpose(-1, -2)) * (0.5 * math.log(10) / 4)
    logits = logits.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    expected = attention.output((logits.softmax(-1) @ v).transpose(1, 2).reshape(3, 10, 32))
    torch.testing.assert_close(attention(x), expected)


def _config_without_callbacks(name: str) -> dict:
    """The YAML as LightningCLI reads it, minus ``trainer.callbacks`` (the monitor is tested elsewhere)."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    config["trainer"].pop("callbacks")
    return config


@pytest.mark.parametrize("name", ["demo.yaml", "long_context_collapse.yaml", "long_context_logn.yaml"])
def test_config_builds_model_data_and_trainer(name, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["spectral-monitor"])  # pytest's own arguments are not for the CLI
    config = _config_without_callbacks(name)
    config["trainer"]["default_root_dir"] = str(tmp_path)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    cli = LightningCLI(args=config, run=False, save_config_callback=None)

    assert isinstance(cli.model, DemoTransformer)
    assert isinstance(cli.datamodule, SyntheticDataModule)
    for key, value in config["model"]["init_args"].items():
        assert cli.model.hparams[key] == value, key
    assert cli.model.hparams.vocab_size == cli.datamodule.hparams.vocab_size
    assert cli.model.hparams.seq_len == cli.datamodule.hparams.seq_len
    assert cli.trainer.max_steps == config["trainer"]["max_steps"]


def test_collapse_pair_differs_only_in_logit_scaling():
    collapse = _config_without_callbacks("long_context_collapse.yaml")
    logn = _config_without_callbacks("long_context_logn.yaml")
    collapse_model, logn_model = collapse.pop("model")["init_args"], logn.pop("model")["init_args"]

    assert collapse_model.pop("logit_scaling") == "standard"
    assert logn_model.pop("logit_scaling") == "log_n"
    assert logn_model.pop("log_n_gamma") > 0
    assert collapse_model == logn_model
    collapse["trainer"].pop("logger"), logn["trainer"].pop("logger")  # each run logs to its own directory
    assert collapse == logn


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: DemoTransformer(d_model=64, n_heads=5), "n_heads"),
        (lambda: DemoTransformer(logit_scaling="log_2"), "logit_scaling"),
        (lambda: DemoTransformer(log_n_gamma=1.0), "log_n_gamma"),
        (lambda: DemoTransformer(logit_scaling="log_n", log_n_gamma=-1.0), "log_n_gamma"),
        (lambda: DemoTransformer(logit_scaling="log_n", train_seq_len=1), "train_seq_len"),
        (lambda: DemoTransformer(dropout=1.0), "dropout"),
        (lambda: DemoTransformer(lr=0.0), "lr"),
        (lambda: DemoTransformer(init_std=0.0), "init_std"),
        (lambda: DemoTransformer(seq_len=0), "seq_len"),
        (lambda: DemoTransformer(seq_len=8)(torch.zeros(1, 9, dtype=torch.long)), "seq_len"),
        (lambda: attention_logit_scale(16, 0), "n_keys"),
        (lambda: SyntheticDataModule(task="copy"), "task"),
        (lambda: SyntheticDataModule(vocab_size=100), "vocab_size"),
        (lambda: SyntheticDataModule(num_pairs=17), "num_pairs"),
        (lambda: SyntheticDataModule(num_queries=9), "num_queries"),
        (lambda: SyntheticDataModule(seq_len=10), "seq_len"),
        (lambda: SyntheticDataModule(batch_size=0), "batch_size"),
        (lambda: SyntheticDataModule(seed=-1), "seed"),
    ],
)
def test_bad_argument_raises_value_error_naming_it(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()
