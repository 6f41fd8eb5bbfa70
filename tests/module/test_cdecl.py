"""C++ parameter types from mangled names and from ``extern "C"`` declarations (no GPU).

The manglings below are what g++/NVRTC write for the declarations beside them (Itanium C++
ABI); NVRTC itself is run where it is installed, so the reading is checked against the
compiler that produces the names ctxkit meets. Mangled names are read through the optional
demangler (``.[demangle]``): those tests skip without it.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

import ctxkit as ck
from ctxkit.module.ptxsig import (
    CType,
    classify_spelling,
    cpp_param_types,
    mangled_param_types,
    source_param_types,
)

S, U, N = "signed", "unsigned", ""

needs_demangler = pytest.mark.skipif(
    importlib.util.find_spec("cxxfilt") is None,
    reason="the optional C++ demangler is not installed (the demangle extra)",
)

# (mangled name, the declaration it comes from, expected sign of each parameter)
MANGLED = [
    ("_Z4axpyIfEvT_PKS0_PS0_m", "axpy<float>(T, const T*, T*, size_t)", (N, U, U, U)),
    ("_Z10fill_constIiLi7EEvPT_m", "fill_const<int, 7>(T*, size_t)", (U, U)),
    (
        "_Z1kiljmxyhasbc",
        "k(int, long, unsigned, unsigned long, long long, unsigned long long,"
        " unsigned char, signed char, short, bool, char)",
        (S, S, U, U, S, U, U, S, S, U, N),
    ),
    ("_Z2tkIfEvPT_S0_", "tk<float>(T*, T)", (U, N)),
    ("_Z1kv", "k()", ()),
    ("_ZL6staticPfi", "static k(float*, int)", (U, S)),
    ("_ZN2ns6kernelEPKfi", "ns::kernel(const float*, int)", (U, S)),
    ("_ZN2ns6kernelIjEEvPT_S1_", "ns::kernel<unsigned>(T*, T)", (U, U)),
    ("_ZN12_GLOBAL__N_16kernelEPdl", "(anonymous)::kernel(double*, long)", (U, S)),
    ("_Z1kN2ns1SEPS0_i", "k(ns::S, ns::S*, int)", (N, U, S)),
    ("_Z1kN2ns1VIiEES1_j", "k(ns::V<int>, ns::V<int>, unsigned)", (N, N, U)),
    ("_Z1kIiN2ns1SEEvT_PKT0_m", "k<int, ns::S>(T, const U*, size_t)", (S, U, U)),
    (
        "_Z2f1IN2ns1SES1_EvdsNS0_1VIT_EEj",
        "f1<ns::S, ns::S>(double, short, ns::V<T>, unsigned)",
        (N, S, N, U),
    ),
    ("_Z1kSt4pairIifEi", "k(std::pair<int, float>, int)", (N, S)),
    ("_Z1kRKfOi", "k(const float&, int&&)", (U, U)),
    ("_Z1kDhx", "k(half, long long)", (N, S)),
    ("_Z1kIJifEEvDpT_", "k<int, float>(Ts...)", (S, N)),
    ("_Z1kPFviE", "k(void (*)(int))", (U,)),
]


@needs_demangler
@pytest.mark.parametrize(("symbol", "decl", "signs"), MANGLED, ids=[m[0] for m in MANGLED])
def test_mangled_parameter_signs(symbol: str, decl: str, signs: tuple[str, ...]) -> None:
    got = mangled_param_types(symbol)
    assert got is not None, decl
    assert tuple(t.sign for t in got) == signs, decl


@needs_demangler
def test_mangled_spellings() -> None:
    got = mangled_param_types("_Z4axpyIfEvT_PKS0_PS0_m")
    assert [t.spelling for t in got or ()] == ["float", "float const*", "float*", "unsigned long"]
    nested = mangled_param_types("_ZN2ns3VecIfE4fillEPS1_")  # nested names, substitutions
    assert [t.spelling for t in nested or ()] == ["ns::Vec<float>*"]


@needs_demangler
@pytest.mark.parametrize(
    "symbol",
    [
        "vector_add",  # extern "C": not mangled
        "_Z1kS5_",  # a substitution that was never defined
        "_Z1kP",  # truncated
    ],
)
def test_mangled_names_it_cannot_read_give_none(symbol: str) -> None:
    assert mangled_param_types(symbol) is None


def test_without_the_demangler_mangled_names_give_none(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cxxfilt", None)  # import fails: the extra is absent
    assert mangled_param_types("_Z4axpyIfEvT_PKS0_PS0_m") is None


@needs_demangler
def test_nvrtc_lowered_names_are_read() -> None:
    """Name expressions compiled by NVRTC (it runs without a GPU) give the declared signs."""
    compiler = pytest.importorskip("ctxkit.compiler")
    src = """
    namespace ns { struct P { int a; }; }
    template <typename T, typename I>
    __global__ void k(const T* x, T* y, I n, int offset, unsigned count, ns::P p, long long s) {}
    """
    exprs = ("k<float, size_t>", "k<double, int>", "k<ns::P, unsigned char>")
    try:
        compiler.nvrtc_version()
    except ck.CompileError as exc:  # no NVRTC in this environment; any other failure fails
        pytest.skip(f"NVRTC unavailable: {exc}")
    obj = compiler.compile(src, name_expressions=exprs, arch="sm_90", target="ptx", cache=False)
    want = {
        "k<float, size_t>": (U, U, U, S, U, N, S),
        "k<double, int>": (U, U, S, S, U, N, S),
        "k<ns::P, unsigned char>": (U, U, U, S, U, N, S),
    }
    for expr, signs in want.items():
        got = mangled_param_types(obj.lowered_name(expr))
        assert got is not None and tuple(t.sign for t in got) == signs, expr


@pytest.mark.parametrize(
    ("text", "sign"),
    [
        ("int", S),
        ("const int", S),
        ("unsigned", U),
        ("unsigned int", U),
        ("unsigned long long int", U),
        ("long long", S),
        ("long", S),
        ("short", S),
        ("signed char", S),
        ("char", N),
        ("unsigned char", U),
        ("size_t", U),
        ("std::size_t", U),
        ("const size_t", U),
        ("uint32_t", U),
        ("int64_t", S),
        ("ptrdiff_t", S),
        ("bool", U),
        ("float", N),
        ("__half", N),
        ("float4", N),
        ("MyIndex", N),
        ("float*", U),
        ("const float* __restrict__", U),
        ("int&", U),
    ],
)
def test_classify_spelling(text: str, sign: str) -> None:
    assert classify_spelling(text).sign == sign


SOURCE = r"""
#include <cuda_fp16.h>
// extern "C" __global__ void vector_add(int a) {}     <- a comment, not the kernel
/* extern "C" __global__ void scale(long x) {} */
#define MYINT int
const char* note = "__global__ void vector_add(double)";
extern "C" __global__ void __launch_bounds__(256, 2)
vector_add(const float* __restrict__ a, const float *b, float* c,
           size_t n)
{
    if (n) c[0] = a[0] + b[0];
}
extern "C" {
__global__ void many(int, unsigned, unsigned int x, long long y, std::size_t z,
                     const uint32_t w, char c, signed char sc, bool f, __half h,
                     float4 v, int arr[4], unsigned long long int q = 3) {}
__global__ void none(void) {}
__global__ void macro(MYINT x, T y) {}
}
__device__ void helper() { vector_add(nullptr, nullptr, nullptr, 0); }
"""


def test_source_declarations() -> None:
    assert [t.sign for t in source_param_types(SOURCE, "vector_add", 4) or ()] == [U, U, U, U]
    assert (source_param_types(SOURCE, "vector_add", 4) or [])[3] == CType("size_t", U)
    many = source_param_types(SOURCE, "many", 13)
    assert many is not None
    assert [t.sign for t in many] == [S, U, U, S, U, U, N, S, U, N, N, U, U]
    assert source_param_types(SOURCE, "none", 0) == []
    macro = source_param_types(SOURCE, "macro", 2)
    assert [t.sign for t in macro or ()] == [N, N]  # macros are not expanded: unknown


def test_source_without_a_matching_declaration_gives_none() -> None:
    assert source_param_types(SOURCE, "vector_add", 3) is None  # the PTX disagrees
    assert source_param_types(SOURCE, "scale", 1) is None  # only in a comment
    assert source_param_types(SOURCE, "helper", 0) is None  # not __global__
    assert source_param_types(SOURCE, "missing", 1) is None
    assert source_param_types("__global__ void k(int n", "k", 1) is None  # unbalanced


CPP_SOURCE = """
__global__ void widths(unsigned char u8, short s16, int s32, unsigned long long u64,
                       long long s64, float* out, size_t n);
__global__ void widths(unsigned char u8, short s16, int s32, unsigned long long u64,
                       long long s64, float* out, size_t n) {}
__global__ void over(int n) {}
__global__ void over(unsigned n) {}
__global__ void over(int n, int m) {}
template <typename T> __global__ void tmpl(T* x, int n) {}
namespace ns { __global__ void inner(int n) {} }
"""


def test_cpp_kernels_of_known_source_need_no_demangler(monkeypatch) -> None:
    """Without the demangle extra, a C++ kernel at namespace scope with no template
    arguments gets its types from the source its name spells out; overloads with as many
    parameters, templates and nested names stay unknown (the PTX's sizes only)."""
    monkeypatch.setitem(sys.modules, "cxxfilt", None)  # import fails: the extra is absent
    types = cpp_param_types("_Z6widthshsiyxPfm", CPP_SOURCE, 7)
    assert [t.sign for t in types or ()] == [U, S, S, U, S, U, U]
    assert cpp_param_types("_Z6widthshsiyxPfm", None, 7) is None  # no source kept
    assert cpp_param_types("_Z4overi", CPP_SOURCE, 1) is None  # two overloads of 1 parameter
    assert [t.sign for t in cpp_param_types("_Z4overii", CPP_SOURCE, 2) or ()] == [S, S]
    assert cpp_param_types("_Z4tmplIfEvPT_i", CPP_SOURCE, 2) is None  # template arguments
    assert cpp_param_types("_ZN2ns5innerEi", CPP_SOURCE, 1) is None  # a nested name
    assert [t.sign for t in cpp_param_types("plain", "__global__ void plain(int);", 1) or ()] == [S]
