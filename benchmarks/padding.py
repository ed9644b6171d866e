"""Offline padding benchmark (conv-embed): every padding mode against the zero-padding limit.

    .venv/bin/python benchmarks/padding.py [--requests 128] [--out docs/img]

The same as ``batchpilot bench padding``; the code lives in ``batchpilot.bench.padding``.
"""

import sys

from batchpilot.bench.padding import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
