"""Check that a restructure of benchmarks/RESULTS.md lost no figure.

Every line of the old file that holds a digit must appear, whole, in the new
RESULTS.md or in some markdown file under benchmarks/results/. Headings are
compared without their leading '#' marks, since moved sections change level.

    git show REV:benchmarks/RESULTS.md > /tmp/old.md
    python benchmarks/results/check_moved.py /tmp/old.md
"""

import pathlib
import re
import sys


def _norm(line: str) -> str:
    return re.sub(r"^#+ ", "", line.strip())


def main(argv: list[str]) -> int:
    old = pathlib.Path(argv[1]).read_text().splitlines()
    root = pathlib.Path(__file__).resolve().parent
    new = [root.parent / "RESULTS.md", *sorted(root.glob("*.md"))]
    have = {_norm(line) for path in new for line in path.read_text().splitlines()}
    figures = [line for line in old if re.search(r"\d", line)]
    missing = [line for line in figures if _norm(line) not in have]
    for line in missing:
        print("missing:", line[:120])
    print(f"{len(figures) - len(missing)} of {len(figures)} lines with a figure found")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
