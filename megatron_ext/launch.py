"""Run an unmodified Megatron training script with megatron-ext's patch applied.

    torchrun --nproc-per-node 8 -m megatron_ext.launch pretrain_gpt.py <Megatron flags> \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep \\
        --moe-hybridep-capacity-factor 1.5 --moe-hybridep-equal-token-counts

The script runs as `__main__` with its own arguments, exactly as `python pretrain_gpt.py ...`
would run it, after `megatron_ext.patches.apply()`. Before it starts, its arguments go through
Megatron's parser with megatron-ext's checks, so a refused flag is said in one line (exit status
2) before anything else; what importing Megatron logs and warns is said once they pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import warnings
from collections.abc import Iterator

PROG = "python -m megatron_ext.launch"
USAGE = f"{PROG} SCRIPT [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    from megatron_ext.options.arguments import stop

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):
        given = f"; got the flag {argv[0]} first" if argv else ""
        stop(PROG, f"no training script given{given}: the script comes first, its flags after it: {USAGE}")
    script = argv[0]
    if not os.path.isfile(script):
        what = "is a folder, not a script" if os.path.isdir(script) else "no such script"
        stop(PROG, f"{script}: {what}; give the path of a Megatron training script (such as pretrain_gpt.py)")
    with _held_back():  # a refusal below is the only line; on success, what was held is said
        import megatron_ext.patches
        from megatron_ext.options.arguments import check_script_arguments

        patches = megatron_ext.patches
        try:
            patches.apply()
        except (patches.UnsupportedMegatronError, patches.UnsupportedTorchError, patches.MovedSymbolError) as error:
            stop(PROG, str(error))  # what is installed: nothing of the script could run
        check_script_arguments(os.path.basename(script), argv[1:])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


@contextlib.contextmanager
def _held_back() -> Iterator[None]:
    """Hold back the warnings and log records of the block (importing Megatron warns of what is not
    installed; torch logs that no CUDA is found; the patch logs its line); say them after the block,
    in order, or drop them when it exits (a refusal, whose line is then the only one)."""
    records: list[tuple[logging.Logger, logging.LogRecord]] = []
    handle = logging.Logger.handle  # every logger's records pass here once their level allows them
    logging.Logger.handle = lambda logger, record: records.append((logger, record))
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        logging.Logger.handle = handle
    for logger, record in records:
        logger.handle(record)
    for warning in caught:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


if __name__ == "__main__":
    main()
