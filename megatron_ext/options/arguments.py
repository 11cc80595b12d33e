"""megatron-ext's flags in Megatron's argument parser.

With `megatron_ext.patches.apply()` the flags come from Megatron's own `TransformerConfig` group
(the patch swaps in `HybridEPTransformerConfig`), so an unmodified launch knows them. Without the
patch, pass `extra_args_provider` to `megatron.training.arguments.parse_args` (or
`initialize_megatron`). Either way, an invalid combination stops `parse_args` with exit status 2
and one line, `<prog>: error: <message>`, naming the flag and the fix: printed by the job's first
rank only, and without argparse's usage block (Megatron's runs to some 725 lines, on every rank).
Argparse's own errors (a flag it does not know, a value that is not one of the choices or not a
number), for Megatron's flags and megatron-ext's alike, read the same way; for a mistyped flag the
line names the flag meant, when one is close.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from typing import NoReturn

from megatron_ext.logs import first_rank
from megatron_ext.options import (
    CONFIG_PREFIX,
    HybridEPConfigError,
    check_parsed_precision,
    flag,
    near_miss,
    validate,
)

GROUP_TITLE = "megatron-ext HybridEP dispatch"


def refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Stop the parse as argparse does (exit status 2), saying `<prog>: error: <message>` alone."""
    stop(parser.prog, message)


def stop(prog: str, message: str) -> NoReturn:
    """Exit with status 2, saying `<prog>: error: <message>` alone: a refusal before any work.

    No usage block, and said once per job: the job's first rank prints the line to stderr
    (`megatron_ext.logs.first_rank`), every other rank exits 2 without a word.
    """
    if first_rank():
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    sys.exit(2)


def check_script_arguments(prog: str, argv: list[str]) -> None:
    """Parse a training script's `argv` with Megatron's parser (patched: megatron-ext's flags and
    checks) before the script runs, refusing as the script's own parse would (one line, exit 2).

    The script may add flags of its own (`extra_args_provider`): those unknown here pass, but for
    a `--moe-hybridep-` flag, which can only be a mistyped one of megatron-ext's.
    """
    if "-h" in argv or "--help" in argv:  # the script's own parse prints its help, its own flags too
        return
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(prog=prog, allow_abbrev=False))
    install_validation(parser)
    _, unknown = parser.parse_known_args(argv)
    ours = [a.split("=", 1)[0] for a in unknown if a.startswith(flag(CONFIG_PREFIX))]
    if ours:
        parser.error(f"unrecognized arguments: {' '.join(ours)}")


def install_validation(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` refuse invalid megatron-ext option combinations when it parses, and say any
    parse error (an unknown flag, a bad value) in one line without the usage block (idempotent)."""
    if getattr(parser, "_megatron_ext_validates", False):
        return parser
    parse_known_args = parser.parse_known_args

    def parse_and_validate(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        try:
            validate(parsed)
            check_parsed_precision(parsed)
        except HybridEPConfigError as exc:
            refuse(parser, str(exc))
        return parsed, extras

    def error_in_one_line(message):
        # argparse reports an unknown flag or a bad value through `parser.error`, which prints the
        # usage first (Megatron's runs to hundreds of lines and buries the error): the line alone.
        refuse(parser, message + _near_misses(parser, message))

    parser.parse_known_args = parse_and_validate
    parser.error = error_in_one_line
    parser._megatron_ext_validates = True
    return parser


def _near_misses(parser: argparse.ArgumentParser, message: str) -> str:
    """For argparse's "unrecognized arguments: ..." error, the flags the user probably meant
    (`--moe-hybridep-capcity-factor` -> `--moe-hybridep-capacity-factor`), as text to append."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    given = re.findall(r"(?<!\S)--[\w-]+", message)
    closest = {g: near_miss(g, known, cutoff=0.85) for g in given}
    meant = {g: close for g, close in closest.items() if close}
    if not meant:
        return f"; {parser.prog} --help lists the flags"
    if len(given) == 1:
        return f" (did you mean {meant[given[0]]}?)"
    return f" (did you mean {' and '.join(f'{m} for {g}' for g, m in meant.items())}?)"


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-ext's flags (unless the patch already did) and their validation to `parser`."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    from megatron_ext.options.config import FIELD_NAMES, HybridEPTransformerConfig

    if flag(FIELD_NAMES[0]) not in parser._option_string_actions:
        theirs = [f.name for f in fields(HybridEPTransformerConfig) if f.name not in FIELD_NAMES]
        ArgumentGroupFactory(HybridEPTransformerConfig, exclude=theirs).build_group(parser, GROUP_TITLE)
    return install_validation(parser)
