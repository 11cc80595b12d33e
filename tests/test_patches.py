"""`megatron_ext.patches`: apply, revert, patched(), version and moved-symbol checks, and auto.

Megatron-Core is imported once for the module (it is slow to import); every test leaves nothing
patched behind, so other test modules in the same process see stock Megatron.
"""

import contextlib
import logging
import subprocess
import sys

import pytest
import torch

import megatron_ext.patches as patches
import megatron_ext.patches._compat as compat

DISPATCHER = "megatron.core.transformer.moe.moe_layer.MoEFlexTokenDispatcher"
MOE_INIT = "megatron.core.transformer.moe.moe_layer.MoELayer.__init__"
ARGS_CONFIG = "megatron.training.arguments.TransformerConfig"
UTILS_CONFIG = "megatron.training.argument_utils.TransformerConfig"
MLA_CONFIG = "megatron.core.transformer.MLATransformerConfig"
ADD_ARGUMENTS = "megatron.training.arguments.add_megatron_arguments"
TRAINING = "megatron.training.training.get_forward_backward_func"
FULL_GRAPH = "megatron.training.training.FullCudaGraphWrapper"
MOE_REPORT = "megatron.core.transformer.moe.moe_logging.MoEMetricsTracker.report"
CREATE_GRAPHS = "megatron.core.pipeline_parallel.schedules.create_cudagraphs"
TRAIN = "megatron.training.training.train"
ALL_TARGETS = [
    DISPATCHER,
    MOE_INIT,
    ARGS_CONFIG,
    UTILS_CONFIG,
    MLA_CONFIG,
    ADD_ARGUMENTS,
    TRAINING,
    FULL_GRAPH,
    MOE_REPORT,
    CREATE_GRAPHS,
    TRAIN,
]


def current(target):
    """The object at a dotted target now (looked up in the owner's own namespace, as apply does)."""
    owner_name, attribute = target.rsplit(".", 1)
    return vars(patches.resolve(owner_name))[attribute]


@pytest.fixture(scope="module")
def originals():
    """Megatron's own objects at every target, captured before any test patches anything."""
    patches.revert()  # start from stock Megatron whatever ran before
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.training  # noqa: F401

    found = {target: current(target) for target in ALL_TARGETS}
    yield found
    patches.revert()
    assert all(current(target) is found[target] for target in ALL_TARGETS)


@pytest.fixture(scope="module")
def replacements(originals):
    from megatron_ext.dispatcher import HybridEPTokenDispatcher
    from megatron_ext.options.config import HybridEPMLATransformerConfig, HybridEPTransformerConfig

    return {
        DISPATCHER: HybridEPTokenDispatcher,
        ARGS_CONFIG: HybridEPTransformerConfig,
        UTILS_CONFIG: HybridEPTransformerConfig,
        MLA_CONFIG: HybridEPMLATransformerConfig,
    }


@pytest.fixture(autouse=True)
def unpatched_after():
    """Each test starts and ends with nothing patched."""
    assert patches.applied() == ()
    yield
    patches.revert()
    assert patches.applied() == ()


def assert_stock(originals, targets=ALL_TARGETS):
    for target in targets:
        assert current(target) is originals[target], f"{target} is still patched"


def assert_patched(originals, replacements, targets):
    for target in targets:
        now = current(target)
        assert now is not originals[target], f"{target} was not patched"
        if target in replacements:
            assert now is replacements[target], target
        elif target == MOE_INIT:
            assert now.__megatron_ext_original__ is originals[target]
        elif target in (ADD_ARGUMENTS, TRAINING, MOE_REPORT, CREATE_GRAPHS, TRAIN):
            assert now.__wrapped__ is originals[target]


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["megatron_ext", "megatron_ext.patches"])
def test_import_does_not_import_megatron(module):
    code = (
        f"import sys, {module}; "
        "loaded = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
        "assert not loaded, loaded"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_patches_table_covers_every_target():
    assert [p.target for p in patches.PATCHES] == ALL_TARGETS
    assert {p.feature for p in patches.PATCHES} == set(patches.FEATURES)


def test_apply_replaces_every_target_and_logs_it(originals, replacements, caplog):
    caplog.set_level(logging.DEBUG, logger="megatron_ext")
    done = patches.apply()

    assert done == ALL_TARGETS
    assert set(patches.applied()) == set(ALL_TARGETS)
    assert_patched(originals, replacements, ALL_TARGETS)

    import megatron.core.transformer
    import megatron.core.transformer.moe.moe_layer as moe_layer
    import megatron.training.argument_utils as argument_utils
    import megatron.training.arguments as arguments

    from megatron_ext.dispatcher import HybridEPTokenDispatcher
    from megatron_ext.options.config import HybridEPMLATransformerConfig, HybridEPTransformerConfig

    assert moe_layer.MoEFlexTokenDispatcher is HybridEPTokenDispatcher
    assert arguments.TransformerConfig is HybridEPTransformerConfig
    assert argument_utils.TransformerConfig is HybridEPTransformerConfig
    assert megatron.core.transformer.MLATransformerConfig is HybridEPMLATransformerConfig
    assert moe_layer.MoELayer.__init__.__megatron_ext_original__ is originals[MOE_INIT]
    assert arguments.add_megatron_arguments.__wrapped__ is originals[ADD_ARGUMENTS]

    logged = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    for target in ALL_TARGETS:
        assert f"megatron-ext: patched {target}" in logged
    info = [r.getMessage() for r in caplog.records if r.name == patches.__name__ and r.levelno == logging.INFO]
    assert info == [
        f"megatron-ext: patched Megatron-Core (arguments, dispatcher, experts, training: {len(ALL_TARGETS)} attributes)"
    ]  # one line per process


def test_apply_twice_is_harmless(originals, replacements):
    patches.apply()
    first = {target: current(target) for target in ALL_TARGETS}

    assert patches.apply() == []

    for target in ALL_TARGETS:
        assert current(target) is first[target], f"second apply changed {target}"
    # the experts wrapper still wraps Megatron's own __init__, not the first wrapper
    assert current(MOE_INIT).__megatron_ext_original__ is originals[MOE_INIT]
    assert set(patches.applied()) == set(ALL_TARGETS)


def test_revert_restores_every_original(originals, replacements, caplog):
    patches.apply()
    caplog.set_level(logging.DEBUG, logger="megatron_ext")

    restored = patches.revert()

    assert set(restored) == set(ALL_TARGETS)
    assert patches.applied() == ()
    assert_stock(originals)
    logged = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    for target in ALL_TARGETS:
        assert f"megatron-ext: restored {target}" in logged
    assert patches.revert() == []


def test_revert_then_apply_again(originals, replacements):
    patches.apply()
    patches.revert()
    assert patches.apply() == ALL_TARGETS
    assert_patched(originals, replacements, ALL_TARGETS)


def test_patched_applies_and_reverts(originals, replacements):
    with patches.patched() as done:
        assert done == ALL_TARGETS
        assert set(patches.applied()) == set(ALL_TARGETS)
        assert_patched(originals, replacements, ALL_TARGETS)
    assert patches.applied() == ()
    assert_stock(originals)


def test_patched_reverts_on_exception(originals):
    with pytest.raises(KeyError):
        with patches.patched():
            raise KeyError("boom")
    assert patches.applied() == ()
    assert_stock(originals)


def test_patched_nested_in_apply_reverts_only_its_own(originals, replacements):
    assert patches.apply(dispatcher=True, experts=False, arguments=False, training=False) == [DISPATCHER]
    others = [t for t in ALL_TARGETS if t != DISPATCHER]

    with patches.patched() as done:
        assert done == others
        assert_patched(originals, replacements, ALL_TARGETS)

    assert patches.applied() == (DISPATCHER,)
    assert_patched(originals, replacements, [DISPATCHER])
    assert_stock(originals, others)


def test_patched_inside_full_apply_reverts_nothing(originals, replacements):
    patches.apply()
    with patches.patched() as done:
        assert done == []
    assert set(patches.applied()) == set(ALL_TARGETS)
    assert_patched(originals, replacements, ALL_TARGETS)


def test_features_named_by_position_and_reverted_by_name(originals, replacements):
    assert patches.apply("dispatcher", "experts") == [DISPATCHER, MOE_INIT]
    assert_stock(originals, [t for t in ALL_TARGETS if t not in (DISPATCHER, MOE_INIT)])
    assert patches.revert("dispatcher") == [DISPATCHER]  # a string is one name, not its letters
    assert patches.applied() == (MOE_INIT,)
    assert patches.revert(["training"]) == []  # a feature not applied: nothing to restore
    assert patches.revert(MOE_INIT) == [MOE_INIT]  # a dotted name apply() returned
    assert_stock(originals)
    with patches.patched("arguments") as done:
        assert done == [ARGS_CONFIG, UTILS_CONFIG, MLA_CONFIG, ADD_ARGUMENTS]
    assert patches.applied() == ()


@pytest.mark.parametrize("call", ["revert('dispatchr')", "revert(3)", "apply('moe')", "apply(dispatcher=1)"])
def test_a_bad_name_restores_and_patches_nothing(originals, replacements, call):
    patches.apply("dispatcher")
    with pytest.raises((TypeError, ValueError)):
        eval(f"patches.{call}")
    assert patches.applied() == (DISPATCHER,)
    patches.revert()


def test_unsupported_torch_patches_nothing(originals, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.raises(patches.UnsupportedTorchError, match=r"found torch 2\.15\.0.*>=2\.8,<2\.15"):
        patches.apply()
    assert patches.applied() == ()
    assert_stock(originals)


@pytest.mark.parametrize("version", ["0.21.0", "0.18.3"])
def test_unsupported_version_patches_nothing(originals, monkeypatch, version):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: version)

    with pytest.raises(patches.UnsupportedMegatronError) as err:
        patches.apply()

    message = str(err.value)
    assert f"found megatron-core {version}" in message
    assert ">=0.19,<0.21" in message
    assert patches.applied() == ()
    assert_stock(originals)


def test_moved_symbol_patches_nothing(originals, monkeypatch):
    missing = "megatron.core.transformer.moe.moe_layer.NoSuchDispatcher"
    real = patches.PATCHES[0]
    assert real.target == DISPATCHER
    moved = patches._Patch(missing, real.replacement, "dispatcher")
    monkeypatch.setattr(patches, "PATCHES", (real, moved))

    with pytest.raises(patches.MovedSymbolError) as err:
        patches.apply()

    message = str(err.value)
    assert f"`{missing}`" in message
    assert f"megatron-core {compat.megatron_core_version()}" in message
    assert patches.applied() == ()
    assert_stock(originals)  # not even the real target listed before the moved one


def test_moved_module_patches_nothing(originals, monkeypatch):
    missing = "megatron.core.transformer.moe.no_such_module.Dispatcher"
    monkeypatch.setattr(patches, "PATCHES", (*patches.PATCHES, patches._Patch(missing, lambda o: o, "experts")))

    with pytest.raises(patches.MovedSymbolError) as err:
        patches.apply()

    assert f"`{missing}`" in str(err.value)  # the symbol megatron-ext needs, not only its module
    assert f"megatron-core {compat.megatron_core_version()}" in str(err.value)
    assert patches.applied() == ()
    assert_stock(originals)


def test_import_auto_applies_the_patch():
    code = (
        "import megatron_ext.patches.auto as auto, megatron_ext.patches as patches\n"
        "import megatron.core.transformer.moe.moe_layer as moe_layer\n"
        "from megatron_ext.dispatcher import HybridEPTokenDispatcher\n"
        "assert moe_layer.MoEFlexTokenDispatcher is HybridEPTokenDispatcher, moe_layer.MoEFlexTokenDispatcher\n"
        "assert set(auto.PATCHED) == set(patches.applied()), (auto.PATCHED, patches.applied())\n"
        "print('PATCHED ' + ' '.join(auto.PATCHED))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("PATCHED ")]
    assert lines and lines[0].split()[1:] == ALL_TARGETS, result.stdout[-3000:]


def test_apply_dispatcher_only(originals, replacements):
    done = patches.apply(dispatcher=True, experts=False, arguments=False, training=False)

    assert done == [DISPATCHER]
    assert patches.applied() == (DISPATCHER,)
    assert_patched(originals, replacements, [DISPATCHER])
    assert_stock(originals, [t for t in ALL_TARGETS if t != DISPATCHER])


@pytest.mark.parametrize(
    "features, expected",
    [
        ({"dispatcher": False, "experts": True, "arguments": False, "training": False}, [MOE_INIT]),
        (
            {"dispatcher": False, "experts": False, "arguments": True, "training": False},
            [ARGS_CONFIG, UTILS_CONFIG, MLA_CONFIG, ADD_ARGUMENTS],
        ),
        (
            {"dispatcher": False, "experts": False, "arguments": False, "training": True},
            [TRAINING, FULL_GRAPH, MOE_REPORT, CREATE_GRAPHS, TRAIN],
        ),
        ({"dispatcher": False, "experts": False, "arguments": False, "training": False}, []),
    ],
)
def test_apply_selected_features(originals, replacements, features, expected):
    assert patches.apply(**features) == expected
    assert patches.applied() == tuple(expected)
    assert_patched(originals, replacements, expected)
    assert_stock(originals, [t for t in ALL_TARGETS if t not in expected])


def test_capacity_mode_selects_experts_that_take_device_counts():
    import functools
    import types

    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_ext.experts import GroupedMLP
    from megatron_ext.patches._moe_layer import select_experts

    def config(factor, op_fuser=False, static=False):
        return types.SimpleNamespace(
            moe_hybridep_capacity_factor=factor,
            moe_hybridep_static_expert_splits=static,
            use_transformer_engine_op_fuser=op_fuser,
            params_dtype=torch.bfloat16,
            num_moe_experts=8,
        )

    sequential = MoESubmodules(experts=functools.partial(SequentialMLP, submodules=None))
    te = MoESubmodules(experts=functools.partial(TEGroupedMLP, submodules=None))
    ours = MoESubmodules(experts=GroupedMLP)
    assert select_experts(config(None), sequential) is sequential  # blocking: Megatron's experts stay
    assert select_experts(config(1.5), sequential).experts is GroupedMLP  # it reads counts on the host
    assert select_experts(config(1.5), te).experts is GroupedMLP  # TE's unfused path does too
    with _fake_te_grouped_path(supported=True):
        assert select_experts(config(1.5, op_fuser=True), te) is te  # TE's op-fuser path takes device counts
    assert select_experts(config(1.5), ours) is ours
    # Static expert splits hand host-constant counts: the experts that split on the host stay.
    assert select_experts(config(1.5, static=True), sequential) is sequential
    assert select_experts(config(1.5, static=True), te) is te
    assert sequential.experts.func is SequentialMLP  # the shared spec itself is never changed


@contextlib.contextmanager
def _fake_te_grouped_path(supported: bool):
    """A stand-in `transformer_engine...grouped_linear` whose graph-safe check answers `supported`."""
    import types

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops"]
    names += ["transformer_engine.pytorch.ops.basic", "transformer_engine.pytorch.ops.basic.grouped_linear"]
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    calls = []

    def check(recipe, dtype):
        calls.append((recipe, dtype))
        return supported

    sys.modules[names[-1]].is_op_fuser_grouped_tensor_path_supported = check
    try:
        yield calls
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_capacity_mode_refuses_te_op_fuser_that_would_read_counts_on_the_host():
    import functools
    import types

    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.patches._moe_layer import select_experts

    te = MoESubmodules(experts=functools.partial(TEGroupedMLP, submodules=None))
    config = types.SimpleNamespace(
        moe_hybridep_capacity_factor=1.5,
        use_transformer_engine_op_fuser=True,
        params_dtype=torch.bfloat16,
        num_moe_experts=64,
        expert_model_parallel_size=1,
    )
    with _fake_te_grouped_path(supported=False) as calls, pytest.raises(HybridEPConfigError) as refused:
        select_experts(config, te)
    assert calls == [(None, torch.bfloat16)]
    message = str(refused.value)
    assert "--use-transformer-engine-op-fuser" in message and "cuBLASLt >= 13.4" in message
    assert "nvidia-cublas>=13.4" in message and "GroupedMLP" in message
    with _fake_te_grouped_path(supported=True):
        # an older TE: no such check to import
        del sys.modules["transformer_engine.pytorch.ops.basic.grouped_linear"].is_op_fuser_grouped_tensor_path_supported
        with pytest.raises(HybridEPConfigError, match="no graph-safe grouped GEMM") as old_te:
            select_experts(config, te)
        assert "Install Transformer Engine >= 2.14" in str(old_te.value)  # TE first, not cuBLAS
    no_fuser = types.SimpleNamespace(**{**vars(config), "use_transformer_engine_op_fuser": False})
    assert select_experts(no_fuser, te).experts.__name__ == "GroupedMLP"  # no TE needed without the fuser


@pytest.mark.parametrize("supported", [True, False])
def test_te_op_fuser_experts_are_checked_with_the_fp8_recipe_megatron_trains_with(monkeypatch, supported):
    """Capacity mode keeps TE's op-fuser experts only where TE's grouped GEMM takes the counts on
    the device for this dtype and fp8 recipe; the check asks TE with Megatron's recipe object.
    TE is a stand-in here (CI has none)."""
    import types

    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.patches import _moe_layer

    asked = []

    def is_op_fuser_grouped_tensor_path_supported(recipe, dtype):
        asked.append((recipe, dtype))
        return supported

    module = types.ModuleType("transformer_engine.pytorch.ops.basic.grouped_linear")
    module.is_op_fuser_grouped_tensor_path_supported = is_op_fuser_grouped_tensor_path_supported
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Float8BlockScaling:  # what megatron.core.fp8_utils.get_fp8_recipe gives for --fp8-recipe blockwise
        pass

    recipe = Float8BlockScaling()
    monkeypatch.setattr(_moe_layer, "_fp8_recipe", lambda config: recipe if config.fp8 else None)
    for fp8 in ("e4m3", None):
        config = types.SimpleNamespace(params_dtype=torch.bfloat16, fp8=fp8, num_moe_experts=8)
        if supported:
            _moe_layer._check_te_takes_device_counts(config)
        else:
            with pytest.raises(HybridEPConfigError) as refused:
                _moe_layer._check_te_takes_device_counts(config)
            message = str(refused.value)
            if fp8:
                assert "with fp8 recipe Float8BlockScaling" in message and "drop --fp8-format" in message
            else:
                assert "drop --use-transformer-engine-op-fuser" in message and "fp8 recipe" not in message
    assert asked == [(recipe, torch.bfloat16), (None, torch.bfloat16)]


@pytest.mark.parametrize(
    ("experts", "ep", "single_weight", "refused"),
    [
        (64, 1, False, False),
        (128, 1, False, True),
        (128, 2, False, False),
        (256, 2, False, True),
        (128, 1, True, False),
    ],
)
def test_te_op_fuser_experts_beyond_its_grouped_gemm_limit_are_refused_before_the_first_step(
    monkeypatch, experts, ep, single_weight, refused
):
    """TE 2.20's grouped GEMM takes at most 64 per-expert weights (seen on an H200: 128 fail inside
    the first forward); more local experts are refused at the layer build, with the two fixes,
    before TE is even asked about the dtype. One grouped weight has no such limit."""
    import types

    from megatron_ext.options import HybridEPConfigError
    from megatron_ext.patches import _moe_layer

    asked = []
    module = types.ModuleType("transformer_engine.pytorch.ops.basic.grouped_linear")
    module.is_op_fuser_grouped_tensor_path_supported = lambda recipe, dtype: asked.append(dtype) or True
    monkeypatch.setitem(sys.modules, module.__name__, module)
    config = types.SimpleNamespace(
        params_dtype=torch.bfloat16,
        fp8=None,
        num_moe_experts=experts,
        expert_model_parallel_size=ep,
        moe_single_grouped_weight=single_weight,
    )
    if not refused:
        _moe_layer._check_te_takes_device_counts(config)
        assert asked == [torch.bfloat16]
        return
    with pytest.raises(HybridEPConfigError) as error:
        _moe_layer._check_te_takes_device_counts(config)
    message = str(error.value)
    assert f"each rank holds {experts // ep} experts" in message and "at most 64" in message
    assert "--expert-model-parallel-size" in message and "--moe-single-grouped-weight" in message
    assert asked == []
    # In fp8 Megatron refuses one grouped weight (but for mxfp8): that fix is not offered.
    config.fp8 = "e4m3"
    with pytest.raises(HybridEPConfigError) as error:
        _moe_layer._check_te_takes_device_counts(config)
    assert "--expert-model-parallel-size" in str(error.value) and "--moe-single-grouped-weight" not in str(error.value)


def test_every_runtime_symbol_is_where_this_megatron_core_keeps_it():
    assert {feature for _, feature in patches.RUNTIME_SYMBOLS} <= set(patches.FEATURES)
    for symbol, _ in patches.RUNTIME_SYMBOLS:
        patches.resolve(symbol)  # MovedSymbolError naming it where it is not (some are None until used)


def test_a_moved_runtime_symbol_patches_nothing(originals, monkeypatch):
    missing = "megatron.core.transformer.cuda_graphs.no_such_function"
    monkeypatch.setattr(patches, "RUNTIME_SYMBOLS", (*patches.RUNTIME_SYMBOLS, (missing, "training")))

    with pytest.raises(patches.MovedSymbolError) as err:
        patches.apply()

    assert f"`{missing}`" in str(err.value) and f"megatron-core {compat.megatron_core_version()}" in str(err.value)
    assert patches.applied() == ()
    assert_stock(originals)
    assert patches.apply(training=False)  # the feature that needs it is the one refused
    patches.revert()


def test_a_replacement_that_raises_patches_nothing(originals, monkeypatch):
    """A replacement is made before any is set: one that fails (a megatron-ext module that does not
    import against this Megatron) leaves every target Megatron's own."""
    last = patches.PATCHES[-1]

    def broken(original):
        raise ImportError("cannot import name 'moved' from 'megatron.core.somewhere'")

    monkeypatch.setattr(patches, "PATCHES", (*patches.PATCHES[:-1], patches._Patch(last.target, broken, last.feature)))
    with pytest.raises(ImportError, match="moved"):
        patches.apply()
    assert patches.applied() == ()
    assert_stock(originals)


def test_every_megatron_symbol_imported_inside_a_function_is_a_runtime_symbol():
    """The imports megatron-ext's modules make when a function runs (after `apply()` checked the
    release) must be in RUNTIME_SYMBOLS: a symbol a later release moved is then named at `apply()`,
    before anything is patched. So must the module-level imports of every module that importing
    `megatron_ext.patches` does not load (the dispatcher, the experts: imported by a patch's
    replacement or at the model build). The bench and tools are not training code."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    listed = {symbol for symbol, _ in patches.RUNTIME_SYMBOLS}
    package = Path(patches.__file__).parent.parent
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, megatron_ext.patches; print(*sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    unlisted = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if {"bench", "tooling"} & set(relative.parts):
            continue
        module = ".".join((package.name, *relative.with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        scopes = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if module not in loaded:
            scopes.append(ast.Module(body=[n for n in tree.body if isinstance(n, ast.ImportFrom)], type_ignores=[]))
        for function in scopes:
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
                    for alias in node.names:
                        symbol = f"{node.module}.{alias.name}"
                        # A module imported whole: the functions used from it are listed.
                        if symbol not in listed and not any(s.startswith(symbol + ".") for s in listed):
                            unlisted.append(f"{path.relative_to(package)}:{node.lineno} {symbol}")
    assert not unlisted, unlisted


def test_every_signature_megatron_ext_relies_on_is_this_megatron_cores():
    assert {feature for _, feature, _ in patches.SIGNATURES} <= set(patches.FEATURES)
    # Each patch target whose replacement passes arguments on is checked; the pass-throughs are not.
    assert {DISPATCHER, MOE_INIT, ADD_ARGUMENTS, FULL_GRAPH, MOE_REPORT, TRAIN} <= {s for s, _, _ in patches.SIGNATURES}
    for symbol, _, takes in patches.SIGNATURES:
        compat.check_signature(symbol, patches.resolve(symbol), takes)  # ChangedSignatureError where not


def _resignatured(monkeypatch, target, function):
    """Megatron's `target` (a method or function in its module) replaced by `function`, as a release
    that changed its parameters would have it."""
    owner_name, attribute = target.rsplit(".", 1)
    monkeypatch.setattr(patches.resolve(owner_name), attribute, function)


@pytest.mark.parametrize(
    ("target", "changed"),
    [
        # track_names renamed: the report patch could no longer add the capacity metrics to it
        (MOE_REPORT, lambda self, loss_scale, iteration, metric_names=None, **kwargs: ""),
        # model no longer second: the warm-up would be handed the wrong argument
        (TRAIN, lambda forward_step_func, config, model, *args, **kwargs: None),
    ],
    ids=["report", "train"],
)
def test_a_resignatured_patch_target_is_named_and_patches_nothing(originals, monkeypatch, target, changed):
    _resignatured(monkeypatch, target, changed)
    with pytest.raises(patches.ChangedSignatureError) as err:
        patches.apply()
    message = str(err.value)
    assert f"`{target}`" in message and f"megatron-core {compat.megatron_core_version()}" in message
    assert "supported: megatron-core >=0.19,<0.21" in message and "\n" not in message
    assert patches.applied() == ()
    monkeypatch.undo()
    assert_stock(originals)
    assert patches.apply(training=False)  # only the feature that calls it is refused
    patches.revert()


def test_a_resignatured_runtime_symbol_is_named_and_patches_nothing(originals, monkeypatch):
    symbol = "megatron.core.transformer.moe.moe_utils.get_align_size_for_quantization"
    _resignatured(monkeypatch, symbol, lambda recipe, config: 0)
    with pytest.raises(patches.ChangedSignatureError, match=f"`{symbol}`"):
        patches.apply()
    assert patches.applied() == ()
    monkeypatch.undo()
    assert_stock(originals)


# The signatures of MoEMetricsTracker.report in megatron-core 0.19 and in 0.20, which inserted
# `num_moe_layers` after `num_layers`.
def _report_019(self, loss_scale, iteration, writer=None, wandb_writer=None, per_layer_logging=False,
                force_initialize=False, track_names=None, num_layers=None, moe_layer_freq=None,
                mtp_num_layers=None, total_loss_dict=None, percentiles=None, pg_collection=None):  # fmt: skip
    return {"track_names": track_names, "num_layers": num_layers, "moe_layer_freq": moe_layer_freq}


def _report_020(self, loss_scale, iteration, writer=None, wandb_writer=None, per_layer_logging=False,
                force_initialize=False, track_names=None, num_layers=None, num_moe_layers=None,
                moe_layer_freq=None, mtp_num_layers=None, total_loss_dict=None, percentiles=None,
                pg_collection=None):  # fmt: skip
    return {"track_names": track_names, "num_layers": num_layers, "moe_layer_freq": moe_layer_freq}


@pytest.mark.parametrize("original", [_report_019, _report_020], ids=["0.19", "0.20"])
@pytest.mark.parametrize("by", ["keyword", "position"])
def test_report_patch_adds_capacity_metrics_however_track_names_is_passed(monkeypatch, original, by):
    import megatron_ext.training.recovery as recovery
    from megatron_ext.dispatcher import CAPACITY_USE_MAX_METRIC, CAPACITY_USE_METRIC

    monkeypatch.setattr(recovery, "_capacity_metrics", True)
    report = patches._moe_metrics_report(original)
    if by == "keyword":
        got = report(None, 1.0, 3, track_names=["load_balancing_loss"], num_layers=4, moe_layer_freq=1)
    else:
        extra = (4, None, 1) if original is _report_020 else (4, 1)  # num_layers[, num_moe_layers], moe_layer_freq
        got = report(None, 1.0, 3, None, None, False, True, ["load_balancing_loss"], *extra)
    assert got == {
        "track_names": ["load_balancing_loss", CAPACITY_USE_METRIC, CAPACITY_USE_MAX_METRIC],
        "num_layers": 4,
        "moe_layer_freq": 1,
    }
    monkeypatch.setattr(recovery, "_capacity_metrics", False)
    assert report(None, 1.0, 3, track_names="z_loss")["track_names"] == "z_loss"  # off: passed as given


def test_megatrons_budget_methods_find_no_budget_on_a_megatron_ext_layer(gloo_group):
    """Megatron's paged-stash runner (--moe-expert-rank-capacity-factor) calls these on every flex
    dispatcher of the model; on a layer megatron-ext drives they report nothing and change nothing
    (megatron-core 0.20 added the last three)."""
    from megatron_ext.dispatcher import HybridEPCapacityManager, HybridEPTokenDispatcher
    from megatron_ext.options import validate
    from tests.megatron_env import FLEX, make_config

    config = make_config(1, **FLEX, moe_hybridep_capacity_factor=1.5)
    manager = HybridEPCapacityManager(
        group=gloo_group,
        num_local_experts=8,
        num_experts=8,
        config=config,
        options=validate(config),
        implementation="torch",
    )
    manager.capacity = 64
    dispatcher = object.__new__(HybridEPTokenDispatcher)  # only its manager is asked
    dispatcher._comm_manager = manager
    before = dict(vars(manager))

    assert dispatcher.check_over_budget() is None
    if hasattr(dispatcher, "check_required_capacity"):
        assert dispatcher.check_required_capacity() is None
    for name, args in [("grow_ep_recv_capacity", (4096,)), ("invalidate_ep_bootstrap", ()), ("reset_over_budget", ())]:
        if hasattr(dispatcher, name):
            getattr(dispatcher, name)(*args)
    assert vars(manager) == before and manager.capacity == 64


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops that would each launch a kernel on a GPU (views and detaches launch none)."""

    FREE = {"select", "view", "reshape", "_unsafe_view", "alias", "detach", "squeeze", "unsqueeze", "expand"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_non_blocking_dispatchs_bookkeeping_launches_few_kernels_and_formats_its_message_once(
    gloo_group, monkeypatch
):
    """After each non-blocking dispatch: the overflow count is one add (and, with the fail policy, an
    assert), the capacity-use metric one multiply and Megatron's add; the assert's message is made
    once per capacity, not per dispatch."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.capacity import capacity_reciprocal, policy
    from megatron_ext.capacity.policy import CAPACITY_USE_METRIC, DeviceCounters
    from megatron_ext.dispatcher import HybridEPCapacityManager
    from megatron_ext.options import validate
    from tests.megatron_env import FLEX, make_config

    config = make_config(1, **FLEX, moe_hybridep_capacity_factor=1.5)
    manager = HybridEPCapacityManager(gloo_group, 8, 8, config, validate(config), "torch")
    manager.capacity = 64
    layer = type("Layer", (), {"layer_number": 1})()  # held: the manager keeps a weak reference
    manager.bind_layer(layer)
    counters = DeviceCounters.zeros(torch.device("cpu"))
    made = []
    monkeypatch.setattr(policy, "device_message", lambda text: made.append(text) or text)
    handle = (None,) * 10 + (torch.tensor([2], dtype=torch.int32),)  # deep_ep's 11 entries, the flag last

    manager.record_overflow = True  # the rerun policy: counted, checked at the step's end
    with _CountOps() as counted:
        manager._assert_no_overflow(handle, counters)
    assert counted.ops == ["add_"] and int(counters.overflows) == 2 and counters.overflows.dtype == torch.int64
    manager.record_overflow = False  # the fail policy: an assert on the device too
    handle[10].zero_()
    with _CountOps() as counted:
        manager._assert_no_overflow(handle, counters)
        manager._assert_no_overflow(handle, counters)
    assert counted.ops == ["add_", "eq", "_assert_async"] * 2
    assert len(made) == 1 and "capacity of 64 rows" in made[0] and "--moe-hybridep-capacity-factor" in made[0]
    manager.capacity = 96
    manager._assert_no_overflow(handle, counters)
    assert len(made) == 2 and "capacity of 96 rows" in made[1]  # a new capacity: a new message
    with pytest.raises(RuntimeError):
        manager._assert_no_overflow((None,) * 10 + (torch.tensor([1], dtype=torch.int32),), counters)

    tracker = get_moe_metrics_tracker()
    tracker._metrics.pop(CAPACITY_USE_METRIC, None)
    manager.log_metrics = True
    rows = torch.tensor(77)  # tokens_per_expert.sum(): int64
    manager._record_capacity_use(rows)  # the first record makes Megatron's entry
    with _CountOps() as counted:
        manager._record_capacity_use(rows)
    assert counted.ops == ["mul", "add_", "copy_"]  # ours: the multiply; Megatron's `values[i] += use`: the rest
    recorded = tracker._metrics.pop(CAPACITY_USE_METRIC).values
    assert torch.equal(recorded[0], 2 * (rows.float() * capacity_reciprocal(96)))  # bit for bit the two-step value
