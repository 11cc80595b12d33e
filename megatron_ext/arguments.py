"""megatron-ext's flags in Megatron's argument parser.

With `megatron_ext.patches.apply()` the flags come from Megatron's own `TransformerConfig` group
(the patch swaps in `HybridEPTransformerConfig`), so an unmodified launch knows them. Without the
patch, pass `extra_args_provider` to `megatron.training.arguments.parse_args` (or
`initialize_megatron`). Either way, an invalid combination stops `parse_args` with a usage error
naming the flag and the fix.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from megatron_ext.options import HybridEPConfigError, flag, validate

GROUP_TITLE = "megatron-ext HybridEP dispatch"


def install_validation(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` refuse invalid megatron-ext option combinations when it parses (idempotent)."""
    if getattr(parser, "_megatron_ext_validates", False):
        return parser
    parse_known_args = parser.parse_known_args

    def parse_and_validate(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        try:
            validate(parsed)
        except HybridEPConfigError as exc:
            parser.error(str(exc))
        return parsed, extras

    parser.parse_known_args = parse_and_validate
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
