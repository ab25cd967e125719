"""NVRTC compile check without a GPU: every kernel variant compiles for sm_80 and sm_90 at
several source-count bounds with exactly the options the cupy loader passes
(``launch.compile_options``), and a bound outside [1, 64] or a missing define fails with
the source's static_assert / #error text. cuda-core compiles to cubin, which needs NVRTC
only (no driver); cupy.RawModule is never called here. tests/conftest.py skips the module
where cuda-core is missing or NVRTC cannot compile (``needs_nvrtc``)."""

import pytest

from kvcanary.backends.cuda import launch as L

pytestmark = pytest.mark.needs_nvrtc

ARCHES = ("sm_80", "sm_90")
BOUNDS = (1, 4, 8, 64)
VARIANTS = [("verify", False), ("verify", True), ("write", False)]


def program_options(options, arch):
    """cuda.core ProgramOptions equal to the loader's NVRTC option strings."""
    from cuda import core

    std, includes, defines = None, [], []
    for option in options:
        if option.startswith("-std="):
            std = option[len("-std="):]
        elif option.startswith("-I"):
            includes.append(option[2:])
        elif option.startswith("-D"):
            name, _, value = option[2:].partition("=")
            defines.append((name, value))
        else:
            raise AssertionError(f"compile check does not know loader option {option!r}")
    return core.ProgramOptions(arch=arch, std=std, include_path=includes or None,
                               define_macro=defines or None)


def compile_kernel(kernel, bound, check, arch):
    from cuda import core

    options = program_options(L.compile_options(kernel, bound, check), arch)
    return core.Program(L.kernel_source(kernel), "c++", options).compile("cubin")


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("kernel,check", VARIANTS)
def test_variant_compiles(kernel, check, bound, arch):
    code = compile_kernel(kernel, bound, check, arch)
    assert len(code.code) > 0


@pytest.mark.parametrize("arch", ARCHES)
def test_plan_compiles_without_a_bound(arch):
    assert len(compile_kernel("plan", None, False, arch).code) > 0


@pytest.mark.parametrize("bound", [0, 65, -1])
@pytest.mark.parametrize("kernel", ["verify", "write"])
def test_bound_out_of_range_fails_with_static_assert(kernel, bound):
    with pytest.raises(Exception) as info:
        compile_kernel(kernel, bound, False, "sm_90")
    assert "KVC_MAX_REAL_KV_SOURCES must be in [1, 64]" in str(info.value)


@pytest.mark.parametrize("kernel", ["verify", "write"])
def test_missing_bound_fails_with_error_directive(kernel):
    with pytest.raises(Exception) as info:
        compile_kernel(kernel, None, False, "sm_80")
    assert "KVC_MAX_REAL_KV_SOURCES must be defined" in str(info.value)


def test_missing_verify_variant_define_fails():
    from cuda import core

    options = program_options([o for o in L.compile_options("verify", 4, False)
                               if "KVC_CHECK_VERIFY_EXPECTED_TOKEN" not in o], "sm_80")
    with pytest.raises(Exception) as info:
        core.Program(L.kernel_source("verify"), "c++", options).compile("cubin")
    assert "KVC_CHECK_VERIFY_EXPECTED_TOKEN must be defined" in str(info.value)


def test_loader_options_carry_the_bound_and_variant():
    options = L.compile_options("verify", 16, True)
    assert "-DKVC_MAX_REAL_KV_SOURCES=16" in options
    assert "-DKVC_CHECK_VERIFY_EXPECTED_TOKEN=1" in options
    assert "-std=c++17" in options
    assert not any("KVC_CHECK" in o for o in L.compile_options("write", 4))
