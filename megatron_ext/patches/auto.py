"""`import megatron_ext.patches.auto` applies megatron-ext's patches to Megatron-Core (see `apply`).

Import it before Megatron parses its arguments: the patch adds megatron-ext's flags to that parse.
Imported after it, it stops the process in one line saying so (exit status 2): the flags were not
parsed, and the run would go on without them.
"""

import sys

from megatron_ext.patches import apply


def _parsed_already() -> bool:
    """Whether Megatron has parsed its arguments in this process (its global args are set)."""
    global_vars = sys.modules.get("megatron.training.global_vars")  # not imported: nothing parsed
    return global_vars is not None and getattr(global_vars, "_GLOBAL_ARGS", None) is not None


if _parsed_already():
    from megatron_ext.options.arguments import stop

    stop(
        "megatron_ext.patches.auto",
        "imported after Megatron parsed its arguments, so its --moe-hybridep-* flags were not part of the "
        "parse; import it before parse_args/initialize_megatron/pretrain, or run the script with "
        "python -m megatron_ext.launch",
    )
PATCHED = apply()
