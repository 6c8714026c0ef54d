"""Prints the conformance table: model family x padding case -> verified, with the largest error measured.

Run from the repository root: ``python tests/conformance/conformance_table.py`` (about a minute on a CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

import torch  # noqa: E402
from conformance_harness import largest_error, run_monitored  # noqa: E402
from conformance_models import FAMILIES  # noqa: E402

CASES = ("no_padding", "right_padding", "left_padding", "fully_padded_sequence", "single_token_sequence")


def main() -> None:
    torch.set_num_threads(1)
    print("| family | " + " | ".join(case.replace("_", " ") for case in CASES) + " |")
    print("|---" * (len(CASES) + 1) + "|")
    for name, build in FAMILIES.items():
        family = build()
        run = run_monitored(family)
        cells = []
        for case in CASES:
            if case not in family.cases:
                cells.append("n/a")
                continue
            layers, blocks = family.reference(family.cases[case])
            try:
                cells.append(f"verified ({largest_error(run.logged[case], layers, blocks):.1e})")
            except AssertionError as error:
                cells.append(f"FAILED: {str(error)[:60]}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
