"""`python -m megatron_ext.launch SCRIPT ARGS`: the script runs as __main__, patched, with its args."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_launch_runs_the_script_patched_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import megatron.core.transformer.moe.moe_layer as moe_layer
            from megatron.training.arguments import parse_args
            args = parse_args()
            print("NAME", __name__)
            print("DISPATCHER", moe_layer.MoEFlexTokenDispatcher.__name__)
            print("FACTOR", args.moe_hybridep_capacity_factor)
            """
        )
    )
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "8"]
    argv += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep", "--bf16"]
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch", str(script), *argv, "--moe-hybridep-capacity-factor", "1.5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NAME __main__" in result.stdout
    assert "DISPATCHER HybridEPTokenDispatcher" in result.stdout
    assert "FACTOR 1.5" in result.stdout


def test_launch_refuses_a_missing_script(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch", str(tmp_path / "nope.py")], capture_output=True, text=True
    )
    assert result.returncode != 0 and "no such script" in result.stderr
