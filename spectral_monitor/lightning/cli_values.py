"""The monitor's option values LightningCLI cannot write back by itself, taught to jsonargparse.

LightningCLI saves the config of every run (``config.yaml`` in the log directory) with jsonargparse, which
writes a dataclass nested in a mapping, such as each :class:`~spectral_monitor.probes.QKVLayout` of
``attention_families.qkv_layouts``, as a warning string that cannot be read back. Registering the layout's
fields as its YAML form makes the saved config a valid config: reading it back gives the same options.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from spectral_monitor.probes.attention_families import QKVLayout

__all__ = ["register_cli_values"]


def register_cli_values() -> bool:
    """Teach jsonargparse, when it is installed, to write a :class:`QKVLayout` as its fields and read it back.

    Returns:
        Whether jsonargparse is installed (and the values are now registered).

    Examples:
        >>> import dataclasses
        >>> from jsonargparse import ArgumentParser
        >>> register_cli_values()
        True
        >>> parser = ArgumentParser()
        >>> _ = parser.add_argument("--layouts", type=dict[str, QKVLayout])
        >>> given = '{"*.attn": {"projection": "Wqkv", "layout": "interleaved"}}'
        >>> config = parser.parse_args([f"--layouts={given}"])
        >>> print(parser.dump(config).strip())
        layouts:
          '*.attn':
            projection: Wqkv
            layout: interleaved
    """
    if importlib.util.find_spec("jsonargparse") is None:
        return False
    from jsonargparse.typing import register_type

    register_type(QKVLayout, serializer=_fields_given, deserializer=_layout_of_fields)
    return True


def _fields_given(layout: QKVLayout) -> dict[str, str | int]:
    return {name: value for name, value in dataclasses.asdict(layout).items() if value is not None}


def _layout_of_fields(fields: dict[str, str | int] | QKVLayout) -> QKVLayout:
    return fields if isinstance(fields, QKVLayout) else QKVLayout(**fields)
