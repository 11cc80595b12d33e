"""Run an unmodified Megatron training script with megatron-ext's patch applied.

    torchrun --nproc-per-node 8 -m megatron_ext.launch pretrain_gpt.py <Megatron flags> \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep \\
        --moe-hybridep-capacity-factor 1.5 --moe-hybridep-equal-token-counts

The script runs as `__main__` with its own arguments, exactly as `python pretrain_gpt.py ...`
would run it, after `megatron_ext.patches.apply()`.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_ext.launch: no such script: {script}")
    import megatron_ext.patches

    megatron_ext.patches.apply()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
