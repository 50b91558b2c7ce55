#!/usr/bin/env python3
"""Benchmarks as regression guards: runs cast_bench, gather_bench, train_bench
and delta_bench briefly and fails when a figure is worse than twice its goal.

Every figure checked is a ratio each bench prints against a baseline it
measured in the same run, never an absolute time (these machines are shared
and noisy). "Twice its goal": a goal of at most G fails above 2G, a goal of
at least G fails below G/2, unless a figure names its own limit where this
machine's spread is wider (train_bench's step/alone). A bench whose figure fails is run once more, and
the stage fails only when the figure fails again, so one noisy run on a
busy machine does not turn the suite red while a real regression (train_bench's
step/alone was 16 before the step's bookkeeping was fixed) still does.

Figures whose goal this 2-core machine does not meet today (the exact
cast-error telemetry, gather_bench's b/a, delta_bench's W=8 / W=1) are printed by the
benches but not guarded here: a guard that is red from the start guards
nothing. docs/performance.md says where each stands.

Usage: bench/smoke.py [BUILD_DIR]   (default build)
"""

import re
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Figure:
    name: str      # as the report names it
    pattern: str   # regex whose group 1 is the value in the bench's output
    goal: float
    at_most: bool  # the goal is an upper bound (else a lower one)
    # Fails past this instead of twice the goal, where this machine's own
    # spread reaches twice the goal (measured, and said where it is set).
    fails_past: float = 0.0

    def limit(self):
        if self.fails_past:
            return self.fails_past
        return 2 * self.goal if self.at_most else self.goal / 2

    def passes(self, value):
        return value <= self.limit() if self.at_most else value >= self.limit()


@dataclass
class Bench:
    binary: str
    args: list
    figures: list
    timeout_s: int


BENCHES = [
    Bench("cast_bench",
          ["--smoke", "--benchmark_filter=^(memcpy|shard_cast/(bf16|f16))(\\+error)?/"], [
        # A streaming cast reads fp32 and writes half of it: memcpy's bytes
        # are its bound (goal: no slower than memcpy of the same fp32).
        Figure("shard_cast/bf16 vs memcpy", r"^shard_cast/bf16\s+\S+\s+([\d.]+)x", 1.0, False),
        Figure("shard_cast/f16 vs memcpy", r"^shard_cast/f16\s+\S+\s+([\d.]+)x", 1.0, False),
        # The sampled cast-error telemetry, in percent of the cast, the
        # worst of the four dtypes' paired rows (goal: at most 10%).
        Figure("sampled cast-error telemetry %",
               r"^(?:bf16|f16|float8_e4m3fn|float8_e5m2)\s+\S+%\s+\+?(-?[\d.]+)%", 10.0, True),
    ], 120),
    Bench("gather_bench", ["--repeat", "1", "--rounds", "2"], [
        Figure("gather b/c parameters/s", r"^b/c parameters/s:\s+([\d.]+)", 1.8, False),
        Figure("gather (b-a) server CPU / cast alone",
               r"^\(b-a server CPU s/GB\) / cast-only s/GB:\s+([\d.]+)", 1.2, True),
    ], 180),
    Bench("train_bench", ["--rounds", "2"], [
        Figure("train b/a", r"^b/a ([\d.]+)", 1.8, True),
        # Guarded for the regression it caught (16x, the step's
        # bookkeeping). On this machine it spreads past twice its goal from
        # run to run: 2.1-2.8 in three runs of e397196, 1.8-3.6 in seven
        # of fb03b8b (two of them in one CI run), 2026-12-07.
        Figure("train step/alone", r"^step/alone ([\d.]+)", 1.5, True, fails_past=4.5),
        Figure("train c/f", r"^c/f ([\d.]+)", 1.0, True),
    ], 180),
    Bench("delta_bench", ["--steps", "2"], [
        # The worst of the three learning rates' rows.
        Figure("delta bytes / goal", r"^1e-0\d\s+\S+%\s+([\d.]+)", 1.0, True),
        Figure("cold pull / plain gathers", r"^cold pull .*: ([\d.]+)", 1.0, True),
        Figure("delta B/param at 1% changed", r"^\s*1\.0%\s+\S+\s+([\d.]+)", 0.035, True),
    ], 180),
]


def run(build, bench):
    """Runs `bench`; returns ({figure name: worst value}, output, seconds)."""
    start = time.monotonic()
    try:
        result = subprocess.run([f"{build}/bench/{bench.binary}"] + bench.args,
                                capture_output=True, text=True, timeout=bench.timeout_s)
        output = result.stdout + result.stderr
        failed = result.returncode != 0
    except subprocess.TimeoutExpired as e:
        output = f"timed out after {bench.timeout_s} s\n{e.stdout or ''}"
        failed = True
    values = {}
    for figure in bench.figures:
        found = [float(m) for m in re.findall(figure.pattern, output, re.MULTILINE)]
        if found and not failed:
            values[figure.name] = max(found) if figure.at_most else min(found)
    return values, output, time.monotonic() - start


def check(build, bench):
    """Returns the names of the figures that failed twice (or went missing)."""
    for attempt in (1, 2):
        values, output, seconds = run(build, bench)
        failing = []
        for figure in bench.figures:
            value = values.get(figure.name)
            ok = value is not None and figure.passes(value)
            bound = "<=" if figure.at_most else ">="
            shown = "missing" if value is None else f"{value:.3f}"
            print(f"bench-smoke: {figure.name:40s} {shown:>8s}  (goal {bound} {figure.goal}, "
                  f"fails {'>' if figure.at_most else '<'} {figure.limit():.3f})"
                  f"{'' if ok else '  FAIL'}")
            if not ok:
                failing.append(figure.name)
        print(f"bench-smoke: {bench.binary} took {seconds:.0f} s")
        if not failing:
            return []
        if attempt == 1:
            print(f"bench-smoke: {bench.binary} again: one noisy run is not a regression")
    print(output[-4000:])
    return failing


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    failed = []
    for bench in BENCHES:
        failed += check(build, bench)
    if failed:
        print("bench-smoke: FAILED, worse than twice the goal in two runs: " + ", ".join(failed))
        return 1
    print("bench-smoke: every figure within twice its goal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
