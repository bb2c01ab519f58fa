"""Every csrc/*.cu must compile for sm_90a without register spills (nvcc -cubin, ptxas -v).

Runs on CPU CI (the CPU torch wheel ships the headers; a shim supplies the one generated c10
CUDA header it lacks, see twell.kernels.build._shim_include_dir). Prints registers, spills and
static shared memory per kernel to the terminal (also without -s). Skipped only without nvcc.
For humans: ``python scripts/ptxas_report.py`` prints the same table.
"""
from pathlib import Path

import pytest

from twell.kernels import build

NVCC = build.find_nvcc()
CU_FILES = sorted(build.csrc_dir().glob("*.cu"))
DATA = Path(__file__).parent / "data" / "ptxas"

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")


@pytest.fixture(scope="module")
def csrc_results(request):
    """Compile all csrc/*.cu once, in parallel, and print the ptxas table to the terminal."""
    results = {r.source: r for r in build.compile_all(CU_FILES)}
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print("\n" + build.format_report(list(results.values())))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("source", CU_FILES, ids=[p.name for p in CU_FILES])
def test_csrc_compiles_for_sm90a(csrc_results, source):
    res = csrc_results[source]
    assert res.ok, f"{source.name} does not compile for sm_90a (exit {res.returncode}):\n{res.output[-6000:]}"
    assert res.kernels, f"{source.name}: compiled, but ptxas reported no entry functions"


@pytest.mark.slow
@pytest.mark.parametrize("source", CU_FILES, ids=[p.name for p in CU_FILES])
def test_csrc_kernels_do_not_spill(csrc_results, source):
    res = csrc_results[source]
    if not res.ok:
        pytest.fail(f"{source.name} did not compile (see test_csrc_compiles_for_sm90a)")
    # CUB's own kernels (the training work list's segmented radix sort) are the library's register
    # budget, not ours: its main-policy sort kernel spills 4 bytes with nvcc 13.0.
    ours = [k for k in res.kernels if "cub::" not in k.name.split("(")[0]]
    assert ours, f"{source.name}: no kernels of this project found"
    spills = {k.name: (k.spill_stores, k.spill_loads) for k in ours if k.spills}
    assert not spills, f"{source.name}: kernels spill registers (bytes stores, loads): {spills}"


def test_report_finds_spills_smem_and_barriers():
    """The machinery on known inputs: a kernel forced to spill, and a clean one with static smem."""
    (res,) = build.compile_all([DATA / "spilly.cu"], extra=("-maxrregcount=24",))
    assert res.ok, res.output
    kernels = {k.name.split("(")[0]: k for k in res.kernels}
    assert set(kernels) == {"spilly_kernel", "clean_kernel"}, list(kernels)
    spilly, clean = kernels["spilly_kernel"], kernels["clean_kernel"]
    assert spilly.arch == "sm_90a" and spilly.registers <= 24 and spilly.spill_stores > 0 and spilly.spill_loads > 0
    assert clean.spills == 0 and clean.smem_bytes == 128 * 4 and clean.barriers == 1 and clean.registers > 0
    table = build.format_report([res])
    assert "SPILLS" in table and "spilly_kernel" in table


def test_report_flags_compile_failure():
    (res,) = build.compile_all([DATA / "broken.cu"])
    assert not res.ok and res.returncode != 0
    assert "undefined_symbol_for_test" in res.output
    assert "COMPILE FAILED" in build.format_report([res])


def test_parse_ptxas_text():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 49152 bytes smem, 384 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90a'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers, 352 bytes cmem[0]
"""
    foo, bar = build.parse_ptxas(text)
    assert (foo.mangled, foo.registers, foo.stack_bytes, foo.spill_stores, foo.spill_loads, foo.smem_bytes,
            foo.barriers) == ("_Z3fooPf", 168, 16, 8, 4, 49152, 1)
    assert foo.spills == 12 and bar.spills == 0 and bar.smem_bytes == 0 and bar.registers == 4


CPP_FILES = sorted(build.csrc_dir().glob("*.cpp"))


@pytest.mark.slow
@pytest.mark.skipif(build.shutil.which("c++") is None and build.shutil.which("g++") is None,
                    reason="no C++ compiler on PATH")
@pytest.mark.parametrize("source", CPP_FILES, ids=[p.name for p in CPP_FILES])
def test_csrc_host_sources_parse(source):
    """Host C++ (bindings) must at least parse with the build's flags (-fsyntax-only; no link on CPU)."""
    res = build.check_host_syntax(source)
    assert res.ok, f"{source.name} does not compile (exit {res.returncode}):\n{res.output[-6000:]}"
