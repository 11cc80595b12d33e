"""megatron-ext's flags in Megatron's argument parser.

With `megatron_ext.patches.apply()` the flags come from Megatron's own `TransformerConfig` group
(the patch swaps in `HybridEPTransformerConfig`), so an unmodified launch knows them. Without the
patch, pass `extra_args_provider` to `megatron.training.arguments.parse_args` (or
`initialize_megatron`). Either way, an invalid combination stops `parse_args` with exit status 2
and one line, `<prog>: error: <message>`, naming the flag and the fix: printed by the job's first
rank only, and without argparse's usage block (Megatron's runs to some 745 lines, on every rank).
Argparse's own errors for megatron-ext's flags (a value that is not one of the choices, or not a
number) read the same way; those for Megatron's flags are left as Megatron prints them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import NoReturn

from megatron_ext.logs import first_rank
from megatron_ext.options import (
    CONFIG_PREFIX,
    OPTION_NAMES,
    HybridEPConfigError,
    check_parsed_precision,
    flag,
    validate,
)

GROUP_TITLE = "megatron-ext HybridEP dispatch"
# How argparse names one of megatron-ext's flags in its own errors ("argument --moe-hybridep-x: ...").
_OUR_ARGUMENT_ERRORS: tuple[str, ...] = tuple(f"argument {flag(CONFIG_PREFIX + name)}:" for name in OPTION_NAMES)


def refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Stop the parse as argparse does (exit status 2), saying `<prog>: error: <message>` alone.

    No usage block, and said once per job: the job's first rank prints the line to stderr
    (`megatron_ext.logs.first_rank`), every other rank exits 2 without a word.
    """
    if first_rank():
        sys.stderr.write(f"{parser.prog}: error: {message}\n")
        sys.stderr.flush()
    sys.exit(2)


def install_validation(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` refuse invalid megatron-ext option combinations when it parses (idempotent)."""
    if getattr(parser, "_megatron_ext_validates", False):
        return parser
    parse_known_args = parser.parse_known_args
    error = parser.error

    def parse_and_validate(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        try:
            validate(parsed)
            check_parsed_precision(parsed)
        except HybridEPConfigError as exc:
            refuse(parser, str(exc))
        return parsed, extras

    def error_without_usage_for_our_flags(message):
        # argparse reports a bad value of a flag through `parser.error`; for megatron-ext's flags the
        # error line alone, for every other flag (Megatron's) whatever the parser did before.
        if message.startswith(_OUR_ARGUMENT_ERRORS):
            refuse(parser, message)
        error(message)

    parser.parse_known_args = parse_and_validate
    parser.error = error_without_usage_for_our_flags
    parser._megatron_ext_validates = True
    return parser


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-ext's flags (unless the patch already did) and their validation to `parser`."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    from megatron_ext.config import FIELD_NAMES, HybridEPTransformerConfig

    if flag(FIELD_NAMES[0]) not in parser._option_string_actions:
        theirs = [f.name for f in fields(HybridEPTransformerConfig) if f.name not in FIELD_NAMES]
        ArgumentGroupFactory(HybridEPTransformerConfig, exclude=theirs).build_group(parser, GROUP_TITLE)
    return install_validation(parser)
