"""How long a worker takes to read a degenerate reply: the long runs of `test_formats._LONG_RUNS` (spaces,
reasoning text, digits, nesting), each through its family's parser (`FormatParser.read_text`: the check and
the transformers engine), median of --reps, in ms. Compare two checkouts by running this from each, with the
other first on the path:

    python scripts/bench_long_runs.py
    PYTHONPATH=/tmp/old python scripts/bench_long_runs.py   # a `git worktree` of an earlier version

The cases are the test's, at its sizes: each took the patterns before 31b5bc3 seconds to minutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "unit" / "gateway_workers" / "formats")]

from fake_formats import FAMILIES  # noqa: E402
from family_cases import ALL_TOOLS, QUESTION, family_tokenizer, render  # noqa: E402
from test_formats import _LONG_RUNS  # noqa: E402

import gateway_workers  # noqa: E402
from gateway_workers.formats import detect_parser  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="stop repeating a case after this many seconds")
    args = p.parse_args()
    print(f"gateway_workers from {Path(gateway_workers.__file__).parent}")
    print("| case | family | characters | ms (median) |\n|---|---|---|---|")
    for case in sorted(_LONG_RUNS):
        key, output, _ = _LONG_RUNS[case]
        tokenizer = family_tokenizer(key)
        parser = detect_parser(tokenizer)
        prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
        times: list[float] = []
        spent = 0.0
        while len(times) < args.reps and spent < args.timeout:
            started = time.perf_counter()
            try:
                parser.read_text(output + FAMILIES[key].stop, prefix, ALL_TOOLS)
            except RecursionError:
                pass  # what the parser let escape before 31b5bc3: timed all the same
            times.append(time.perf_counter() - started)
            spent += times[-1]
        print(f"| {case} | {key} | {len(output)} | {statistics.median(times) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
