"""Sweep Poisson rates over several OpenAI-compatible systems and report DistServe goodput.

See pdserve/bench/sweep.py for the flags and the JSON it writes; plot it with
benchmarks/plot_serving.py.
"""

import sys

from pdserve.bench.sweep import main_sweep

if __name__ == "__main__":
    sys.exit(main_sweep())
