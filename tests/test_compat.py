"""Supported Megatron-Core versions are checked, and a moved symbol is named with the version."""

import subprocess
import sys

import pytest

from megatron_ext.patches import (
    MovedSymbolError,
    UnsupportedMegatronError,
    check_megatron_version,
    megatron_core_version,
    resolve,
)


def test_installed_megatron_core_is_supported():
    assert check_megatron_version() == megatron_core_version()


@pytest.mark.parametrize("version", ["0.18.3", "0.20.0", "1.0.0", "0.9.1", "garbage"])
def test_unsupported_version_is_named(version):
    with pytest.raises(UnsupportedMegatronError, match=f"found megatron-core {version}"):
        check_megatron_version(version)


@pytest.mark.parametrize("version", ["0.19.0", "0.19.2", "0.19.3rc1"])
def test_supported_versions(version):
    assert check_megatron_version(version) == version


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
