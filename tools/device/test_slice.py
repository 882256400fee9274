"""Run one contiguous slice of a pytest collection: `python3 tools/device/test_slice.py K N [pytest args...]` runs the
K-th of N slices (1-based) of what `pytest --collect-only` finds for the args (default: the GPU suite, `-m gpu tests
--ignore=tests/server`). The whole GPU suite takes about 570 s with a cold Triton cache on an H100, near the device
tool's 600 s a call: in two or three slices, each call ends with pytest's own summary, and the slices together are
the suite in its own order."""

import subprocess
import sys

import pytest


def main() -> int:
    if len(sys.argv) < 3 or not (sys.argv[1].isdigit() and sys.argv[2].isdigit()) \
            or not 1 <= int(sys.argv[1]) <= int(sys.argv[2]):
        raise SystemExit("usage: test_slice.py K N [pytest args...]  (1 <= K <= N)")
    k, n = int(sys.argv[1]), int(sys.argv[2])
    args = sys.argv[3:] or ["-m", "gpu", "tests", "--ignore=tests/server"]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            capture_output=True, text=True)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        print(listed.stdout[-2000:], listed.stderr[-2000:], sep="\n")
        raise SystemExit("test_slice: pytest collected no tests for " + " ".join(args))
    size = -(-len(ids) // n)
    part = ids[(k - 1) * size:k * size]
    print(f"test_slice: tests {(k - 1) * size + 1}-{(k - 1) * size + len(part)} of {len(ids)}", flush=True)
    marks = [a for i, a in enumerate(args) if a == "-m" or (i and args[i - 1] == "-m")]
    return pytest.main(["-q", "-rf", "-p", "no:cacheprovider", *marks, *part]) if part else 0


if __name__ == "__main__":
    sys.exit(main())
