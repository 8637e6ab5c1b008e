#!/usr/bin/env python
"""Same as `dynatrain bench-switch ...` (see docs/bench/switch.md for the figures).

    python scripts/bench_switch.py --model gpt-50m --nproc 4 --from tp2pp2 --to tp1pp4 --json

The `__main__` guard matters: spawned ranks and dist_checkpointing's helper process
re-import this script.
"""
import sys

if __name__ == "__main__":
    from dynatrain_megatron.cli import main

    sys.exit(main(["bench-switch", *sys.argv[1:]]))
