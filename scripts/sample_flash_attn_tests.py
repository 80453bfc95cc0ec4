r"""Pick a seeded sample of flash-attn's test cases, the same number from each test function.

    python scripts/sample_flash_attn_tests.py COLLECTED N [--seed S] [--exclude REGEX] > ids.txt

COLLECTED is the output of ``pytest --collect-only -q`` on flash-attn's test file (one
``path::test_name[params]`` a line; other lines are ignored).  The full grid is tens of thousands
of cases, most of them in a few functions: a uniform sample would barely touch the others, so each
function gets ``N // functions`` cases (all of them if it has fewer).  Prints the ids
(``test_name[params]``) in the file's order, for ``scripts/run_flash_attn_tests.sh --ids``.
``--exclude`` leaves out the ids a regular expression finds, before sampling: e.g.
``'(\[|-)0\.17(-|\])'`` the dropout cases (dropout is refused with NotImplementedError).
"""
import argparse
import collections
import random
import re


def sample(lines, n: int, seed: int, exclude: str | None = None) -> list[str]:
    ids = [line.strip().split("::", 1)[1] for line in lines if "::" in line and "[" in line]
    if exclude:
        ids = [case for case in ids if not re.search(exclude, case)]
    by_function = collections.defaultdict(list)
    for case in ids:
        by_function[case.split("[", 1)[0]].append(case)
    rng = random.Random(seed)
    per_function = max(1, n // max(1, len(by_function)))
    chosen = set()
    for cases in by_function.values():
        chosen.update(rng.sample(cases, min(per_function, len(cases))))
    return [case for case in ids if case in chosen]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("collected", help="output of pytest --collect-only -q")
    parser.add_argument("n", type=int, help="about how many cases in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", metavar="REGEX", help="leave out the ids this finds")
    args = parser.parse_args(argv)
    with open(args.collected) as f:
        print("\n".join(sample(f, args.n, args.seed, args.exclude)))


if __name__ == "__main__":
    main()
