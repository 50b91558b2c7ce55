#!/usr/bin/env python3
"""Prints the table in tests/README.md: for each source file of the project's
libraries and programs, the test files that include its header (directly);
the folder table above it there gives each folder's ctest labels. Run it after adding a source file or
a test, and paste its output over the table:

    scripts/test-map.py > /tmp/map.md

A source file no test includes directly is listed with "(through others)":
it is exercised by the tests of what uses it, or by the integration tests
that run the binaries.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ["platform", "core", "wire"] + sorted(
    f"server/{room.name}" for room in (ROOT / "server").iterdir() if room.is_dir()) + ["client", "client/gpu", "relay", "tools", "programs",
         "programs/layercast", "programs/layercast-shard",
         "python/src"]
INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.MULTILINE)


def main():
    tests = [p for p in (ROOT / "tests").rglob("*") if p.suffix in (".cc", ".h", ".py")]
    includes = {}
    for test in tests:
        text = test.read_text(errors="replace")
        for header in INCLUDE.findall(text):
            includes.setdefault(header, set()).add(test.relative_to(ROOT / "tests"))
        if test.suffix == ".py" and "import layercast" in text:
            includes.setdefault("python/src", set()).add(test.relative_to(ROOT / "tests"))
    print("| source | tests that include it |")
    print("| --- | --- |")
    for part in PARTS:
        folder = ROOT / part
        stems = sorted({p.stem for p in folder.glob("*") if p.suffix in (".cc", ".h", ".cu")})
        for stem in stems:
            header = f"{part}/{stem}.h"
            users = sorted(includes.get(header, set()))
            if part == "python/src":
                users = sorted(includes.get("python/src", set()))
            shown = ", ".join(f"`{u}`" for u in users) or "(through others)"
            print(f"| `{part}/{stem}` | {shown} |")


if __name__ == "__main__":
    main()
