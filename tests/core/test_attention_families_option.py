"""The ``attention_families`` option: each monitor reads its model with its own registry of attention-family
knowledge, whatever other monitors in the process were given, and a LightningCLI config states one in YAML."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers.events import read_back, scalar_at
from helpers.models import HEADS, TOKENS, VOCAB, WIDTH, FusedHeadsAttention, FusedHeadsModel
from jsonargparse import ArgumentParser
from pytorch_lightning.cli import LightningCLI
from torch import nn

from spectral_monitor import AttentionFamilies, CaptureOptions, Monitor, MonitorOptions, SpectralMonitor
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.probes import QKVLayout, register_qkv_layout
from spectral_monitor.probes.attention_families import qkv_layout_pattern

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = "blocks.0.attn"


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of ``TOKENS`` tokens, the last three of the second padding (``pad_mask`` True)."""
    tokens = torch.randint(VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    pad_mask = torch.zeros(2, TOKENS, dtype=torch.bool)
    pad_mask[1, -3:] = True
    return tokens, pad_mask


@pytest.mark.slow
def test_monitors_in_one_process_each_read_the_model_with_their_own_registry(tmp_path: Path) -> None:
    """Three monitors on one model and batch, stepped in turn: the one given the family's layout, head-count
    attribute and padding keyword splits the fused projection into heads (each head's σ₁ and
    ‖W_Q^hᵀ W_K^h‖₂ equal float64 SVDs of the split rows) and leaves the padded queries out exactly as the
    ``token_mask`` option does; the two with the default registry do neither, and warn of the layout."""
    model, batch = FusedHeadsModel(), padded_batch()
    families = (
        AttentionFamilies()
        .with_qkv_layout(FusedHeadsAttention, QKVLayout("Wqkv", "interleaved"))
        .with_attribute_names(head_count=["n_q_heads"])
        .with_mask_keywords(padding=["pad_mask"])
    )
    common = {"families": ["attention", "weights"], "per_head": True, "preflight": False}
    monitors = {
        "own": Monitor(model, tmp_path / "own", every_n_steps=1, attention_families=families, **common),
        "default": Monitor(model, tmp_path / "default", every_n_steps=1, **common),
        "token_mask": Monitor(
            model, tmp_path / "token_mask", every_n_steps=1, token_mask=lambda batch: ~batch[1], **common
        ),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for monitor in monitors.values():
            with monitor.step(0, batch=batch):
                model(batch[0], pad_mask=batch[1])
            monitor.close()
    events = {name: read_back(tmp_path / name) for name in monitors}

    own = events["own"]
    rows = model.blocks[0]["attn"].Wqkv.weight.detach().double().view(HEADS, 3, WIDTH // HEADS, WIDTH)
    for head in range(HEADS):
        query, key = rows[head, 0], rows[head, 1]
        sigma = scalar_at(own, f"weights/spectral_norm/{ATTENTION}.q/head_{head}", 0)
        assert sigma == pytest.approx(torch.linalg.svdvals(query)[0].item(), rel=1e-5)
        qk = scalar_at(own, f"weights/qk_spectral_norm/{ATTENTION}/head_{head}", 0)
        assert qk == pytest.approx(torch.linalg.svdvals(query.T @ key)[0].item(), rel=1e-5)
    for name in ("default", "token_mask"):
        tags = events[name].Tags()["scalars"]
        assert f"weights/spectral_norm/{ATTENTION}.Wqkv" in tags
        assert not any(tag.startswith("weights/qk_spectral_norm") for tag in tags)
    fused = [str(w.message) for w in caught if 'fuses q, k and v in "Wqkv"' in str(w.message)]
    assert len(fused) == 2  # the two default monitors, once each

    entropy = {name: scalar_at(events[name], f"attention/entropy/{ATTENTION}", 0) for name in monitors}
    assert entropy["own"] == pytest.approx(entropy["token_mask"], rel=1e-6)
    assert entropy["own"] != pytest.approx(entropy["default"], rel=1e-3)


def test_a_monitor_takes_the_process_wide_layouts_registered_by_the_time_it_is_made() -> None:
    registered, own = QKVLayout("Wqkv", "interleaved"), QKVLayout("qkv", "concatenated")
    before = MonitorOptions()
    with register_qkv_layout(FusedHeadsAttention, registered):
        made = SpectralMonitor(per_head=True)
        extended = AttentionFamilies().with_qkv_layout("*.mixer", own)
    after = MonitorOptions()
    fused = qkv_layout_pattern(FusedHeadsAttention)
    assert made.options.capture.attention_families.qkv_layouts[fused] is registered
    assert extended.qkv_layouts[fused] is registered and extended.qkv_layouts["*.mixer"] is own
    assert extended.qkv_layout_of(ATTENTION, FusedHeadsAttention()) is registered
    for options in (before, after):
        assert fused not in options.capture.attention_families.qkv_layouts
    assert after.capture.attention_families == AttentionFamilies()


def test_a_registry_in_yaml_reaches_the_monitor_lightning_cli_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: spectral_monitor.SpectralMonitor
      init_args:
        options:
          capture:
            attention_families:
              head_count_attributes: [n_q_heads, n_head]
              padding_mask_keywords: [pad_mask]
              qkv_layouts:
                FusedHeadsAttention: {projection: Wqkv, layout: interleaved}
                blocks.*.mixer: {projection: qkv, layout: concatenated, num_heads: 4}
model:
  class_path: spectral_monitor.demo.DemoTransformer
data:
  class_path: spectral_monitor.demo.SyntheticDataModule
"""
    )
    cli = LightningCLI(
        DemoTransformer,
        SyntheticDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[f"--config={config}"],
        run=False,
    )
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    families = monitor.options.capture.attention_families
    assert families.head_count_attributes == ("n_q_heads", "n_head")  # a list given replaces the default
    assert families.padding_mask_keywords == ("pad_mask",)
    assert families.real_token_mask_keywords == AttentionFamilies().real_token_mask_keywords  # not given
    assert families.qkv_layouts == {
        "FusedHeadsAttention": QKVLayout("Wqkv", "interleaved"),
        "blocks.*.mixer": QKVLayout("qkv", "concatenated", num_heads=4),
    }
    weights = families.read_attention_weights(ATTENTION, FusedHeadsAttention())  # named by its class
    assert weights is not None and weights.num_heads == HEADS


def test_the_config_lightning_cli_saves_reads_back_to_the_same_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config LightningCLI saves beside each run (``parser.dump(config, skip_none=False)``, as its
    ``SaveConfigCallback`` writes it) holds the registry's layouts as fields, without a warning; given back
    as a config, it makes the same registry."""
    monkeypatch.chdir(tmp_path)
    families = "--trainer.callbacks.options.capture.attention_families"
    arguments = [
        "--trainer.logger=false",
        "--trainer.callbacks=spectral_monitor.SpectralMonitor",
        f"{families}.padding_mask_keywords=[pad_mask]",
        f"{families}.qkv_layouts="
        '{"*.mixer": {"projection": "Wqkv", "layout": "interleaved", "num_heads": 2}}',
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*serialize")
        cli = LightningCLI(DemoTransformer, SyntheticDataModule, args=arguments, run=False)
        saved = tmp_path / "config.yaml"
        saved.write_text(cli.parser.dump(cli.config, skip_none=False))
    assert "Unable to serialize" not in saved.read_text()

    read_back = LightningCLI(DemoTransformer, SyntheticDataModule, args=[f"--config={saved}"], run=False)
    (given,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    (made,) = [callback for callback in read_back.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    assert made.options.capture.attention_families == given.options.capture.attention_families
    assert made.options.capture.attention_families.qkv_layouts == {
        "*.mixer": QKVLayout("Wqkv", "interleaved", num_heads=2)
    }


def test_a_registry_keyed_by_a_module_type_is_written_as_its_import_path_and_read_back() -> None:
    """A layout keyed by a module type is kept under the type's import path: jsonargparse, as LightningCLI
    uses it, writes it to YAML and reads it back, and the path read back matches the type and its
    subclasses, not other classes of the same name."""
    layout = QKVLayout("Wqkv", "interleaved", num_heads=HEADS)
    options = MonitorOptions(
        capture=CaptureOptions(
            attention_families=AttentionFamilies().with_qkv_layout(FusedHeadsAttention, layout)
        )
    )
    parser = ArgumentParser()
    parser.add_argument("--options", type=MonitorOptions, default=options)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*serialize")
        written = parser.dump(parser.parse_args([]))
    assert qkv_layout_pattern(FusedHeadsAttention) == "helpers.models.FusedHeadsAttention"
    assert "helpers.models.FusedHeadsAttention:" in written
    families = parser.instantiate(parser.parse_string(written)).options.capture.attention_families
    assert families == options.capture.attention_families

    class Subclassed(FusedHeadsAttention):
        pass

    class FusedHeadsAttentionOfItsOwn(nn.Module):
        pass

    FusedHeadsAttentionOfItsOwn.__qualname__ = FusedHeadsAttentionOfItsOwn.__name__ = "FusedHeadsAttention"
    assert families.qkv_layout_of(ATTENTION, FusedHeadsAttention()) == layout
    assert families.qkv_layout_of(ATTENTION, Subclassed()) == layout
    assert families.qkv_layout_of(ATTENTION, FusedHeadsAttentionOfItsOwn()) is None
