"""Supported Megatron-Core versions are checked, and a moved symbol is named with the version."""

import subprocess
import sys

import pytest

from megatron_ext.patches import (
    ChangedSignatureError,
    MovedSymbolError,
    Takes,
    UnsupportedMegatronError,
    check_megatron_version,
    megatron_core_version,
    resolve,
)
from megatron_ext.patches._compat import check_signature


def test_installed_megatron_core_is_supported():
    assert check_megatron_version() == megatron_core_version()


@pytest.mark.parametrize("version", ["0.18.3", "0.21.0", "1.0.0", "0.9.1", "garbage"])
def test_unsupported_version_is_named(version):
    with pytest.raises(UnsupportedMegatronError, match=f"found megatron-core {version}"):
        check_megatron_version(version)


@pytest.mark.parametrize("version", ["0.19.0", "0.19.2", "0.19.3rc1", "0.20.0", "0.20.1rc0"])
def test_supported_versions(version):
    assert check_megatron_version(version) == version


def test_unsupported_version_names_the_supported_range_and_the_install_command():
    with pytest.raises(UnsupportedMegatronError) as err:
        check_megatron_version("0.21.0")
    assert "megatron-core >=0.19,<0.21" in str(err.value)
    assert "pip install 'megatron-core>=0.19,<0.21'" in str(err.value)
    assert "\n" not in str(err.value)


def test_resolve_finds_a_real_symbol():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    assert resolve("megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher") is MoEFlexTokenDispatcher


@pytest.mark.parametrize(
    "dotted",
    [
        "megatron.core.transformer.moe.token_dispatcher.NoSuchDispatcher",
        "megatron.core.transformer.moe.no_such_module.Thing",
        "megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher.no_such_method",
    ],
)
def test_moved_symbol_names_symbol_and_version(dotted):
    with pytest.raises(MovedSymbolError) as err:
        resolve(dotted)
    assert dotted in str(err.value) and megatron_core_version() in str(err.value)


def test_importing_megatron_ext_does_not_import_megatron():
    code = (
        "import sys, megatron_ext, megatron_ext.hybridep, megatron_ext.tooling.sync, megatron_ext.patches; "
        "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _report(self, loss_scale, iteration, track_names=None, num_layers=None, num_moe_layers=None, **kwargs):
    """A stand-in for a Megatron method, with the parameters the checks below look for."""


@pytest.mark.parametrize(
    "takes",
    [
        Takes(("loss_scale", "iteration")),
        Takes(("loss_scale",), ("track_names", "num_moe_layers")),
        Takes(keyword=("iteration",)),
        Takes(),
    ],
)
def test_a_signature_that_takes_the_call_passes(takes):
    check_signature("megatron.core.x.Tracker.report", _report, takes)


@pytest.mark.parametrize(
    "takes",
    [
        Takes(("iteration", "loss_scale")),  # reordered
        Takes(("loss_scale", "iteration", "writer")),  # a positional parameter it does not have
        Takes(keyword=("writer",)),  # only **kwargs would take it: a renamed parameter
        Takes(("loss_scale", "iteration", "track_names", "moe_layer_freq")),  # 0.20 inserted num_moe_layers
    ],
)
def test_a_changed_signature_is_named_in_one_line(takes):
    with pytest.raises(ChangedSignatureError) as err:
        check_signature("megatron.core.x.Tracker.report", _report, takes)
    message = str(err.value)
    assert "`megatron.core.x.Tracker.report`" in message and megatron_core_version() in message
    assert "supported: megatron-core >=0.19,<0.21" in message and "\n" not in message
    assert isinstance(err.value, MovedSymbolError)  # caught wherever a moved symbol is


def test_a_class_is_checked_by_its_init():
    class Wrapper:
        def __init__(self, forward_backward_func, warmup_steps=1):
            pass

    check_signature("megatron.x.Wrapper", Wrapper, Takes(("forward_backward_func",)))
    with pytest.raises(ChangedSignatureError, match="megatron.x.Wrapper"):
        check_signature("megatron.x.Wrapper", Wrapper, Takes(("step_func",)))
