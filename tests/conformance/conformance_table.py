"""Prints the conformance table: model family x padding case -> verified, with the largest error measured.

Run from the repository root: ``python tests/conformance/conformance_table.py`` (about a minute on a CPU).
Each cell is checked by the same ``assert_conforms`` as ``test_conformance.py`` (the logit growth of a case
against the case before it); the exit status is 1 when a cell failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

import torch  # noqa: E402
from conformance_harness import assert_conforms, run_monitored  # noqa: E402
from conformance_models import FAMILIES  # noqa: E402

CASES = ("no_padding", "right_padding", "left_padding", "fully_padded_sequence", "single_token_sequence")


def main() -> int:
    torch.set_num_threads(1)
    failed = False
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
            try:
                cells.append(f"verified ({assert_conforms(family, run, case):.1e})")
            except AssertionError as error:
                failed = True
                cells.append(f"FAILED: {str(error)[:60]}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
