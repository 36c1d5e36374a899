"""``python tests/harness/durations.py JUNIT_XML [OUT]``: each test's measured seconds, from a
``pytest --junitxml`` run, into ``tests/durations.json`` (what tests/conftest.py orders the tests
by under xdist). Prints the slowest 25 and the per-file totals."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def node_id(case: ET.Element) -> str:
    """``tests/dir/test_file.py::test_name[param]`` of a junit ``testcase`` (module-level tests)."""
    module = case.get("classname", "")
    return module.replace(".", "/") + ".py::" + case.get("name", "")


def durations(junit: Path) -> dict[str, float]:
    return {node_id(c): round(float(c.get("time", 0)), 2) for c in ET.parse(junit).iter("testcase")}


def main() -> None:
    junit = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "tests" / "durations.json"
    times = durations(junit)
    out.write_text(json.dumps(dict(sorted(times.items())), indent=0) + "\n")
    per_file: dict[str, float] = defaultdict(float)
    for node, t in times.items():
        per_file[node.split("::")[0]] += t
    print(f"{len(times)} tests, {sum(times.values()):.0f} s in all (both workers)")
    print("slowest tests:")
    for node, t in sorted(times.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {t:8.1f}  {node}")
    print("per file:")
    for path, t in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"  {t:8.1f}  {path}")


if __name__ == "__main__":
    main()
