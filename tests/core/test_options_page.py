"""The configuration page lists every option in the group where MonitorOptions defines it."""

from __future__ import annotations

import re
from pathlib import Path

from spectral_monitor.core import options


def test_the_configuration_page_groups_every_option_where_monitor_options_defines_it() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = page[page.index("## Options") : page.index("### Presets")]
    listed = {}
    for line in table.splitlines():
        cells = line.split(" | ")
        if len(cells) == 3 and line.startswith("| (none)"):
            listed.update(dict.fromkeys(re.findall(r"`(\w+)`", cells[2]), None))
        elif len(cells) == 3 and line.startswith("| `"):
            listed.update(dict.fromkeys(re.findall(r"`(\w+)`", cells[2]), cells[0].strip("| `")))
    groups = set(listed.values()) - {None}
    assert groups == {"capture", "outputs", "budget"}
    assert listed == {name: group for name, group in options.KEYWORD_GROUPS.items() if name not in groups}
