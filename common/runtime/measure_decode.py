"""The command that takes this machine's decode measurement for `--precision.decode=auto`:

    python -m common.runtime.measure_decode

`common/engine/machine/decode_choice.py: take` in a process set up as a generator's
(`set_process_defaults`): its thread count, which keys the machine's cache file, and its kept freed
memory (with glibc's defaults instead, the eager step's big temporaries are served by whatever the
compile left of the allocator, and the eager side's timing depends on whether it compiled cold).
About a minute (a compile of the decode pieces), once per machine; prints one JSON line.
"""
from __future__ import annotations

import argparse
import json

from common.engine.machine.decode_choice import ROUNDS, take
from common.runtime.process import set_process_defaults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="alternating timed rounds, eager and compiled")
    a = ap.parse_args()
    set_process_defaults("cpu")
    print(json.dumps(take(a.rounds)))


if __name__ == "__main__":
    main()
