"""kernels/csrc/kernels.h is the one declaration of the C library's
functions and structs: the library exports exactly what it declares, every
function Python calls is declared there, ctypes reads its signatures and
structs from it (kernels/c_header.py), and a declaration that disagrees with
its definition fails the build, so loading fails rather than a call passing
the wrong arguments."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import c_header, cpu_build

pytestmark = pytest.mark.skipif(cpu_build.why_unavailable() is not None, reason="no C compiler here")


def test_the_library_exports_what_the_header_declares_and_python_calls_only_that():
    lib = cpu_build.load_library()
    symbols = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True,
                             check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == set(cpu_build.SIGNATURES)
    called = set()
    for path in Path(cpu_build.__file__).parent.glob("*.py"):
        called |= set(re.findall(r"load_library\([^)]*\)\.(\w+)\(", path.read_text()))
        called |= set(re.findall(r"getattr\(load_library\([^)]*\), \"(\w+)\"\)", path.read_text()))
    assert called and called <= exported, called - exported
    for name, (argtypes, restype) in cpu_build.SIGNATURES.items():  # typed from the header on load
        assert getattr(lib, name).argtypes == argtypes and getattr(lib, name).restype is restype


def test_a_header_that_disagrees_with_a_definition_fails_loading(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_build.CSRC, csrc)
    header = csrc / "kernels.h"
    text = header.read_text()
    changed = text.replace("int64_t rows, int64_t inter,", "int rows, int64_t inter,")  # silu_mul_bf16
    assert changed != text
    header.write_text(changed)
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_build.KernelBuildError, match="conflicting types for .silu_mul_bf16"):
        cpu_build._load_library("x86-64", csrc)


def test_structs_and_prototypes_are_read_from_the_header():
    text = """/* a comment: int ignored(int x); */
#define X 3
typedef struct {
    const uint16_t *a, *b;
    const uint8_t *c[4];
    int64_t n, m;
    float eps;
} shape_t;
void f(const void *p, int64_t n, float s, int k);
int g(void);
"""
    shape = c_header.structs(text)["shape_t"]
    assert shape._fields_ == [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p * 4),
                              ("n", ctypes.c_int64), ("m", ctypes.c_int64), ("eps", ctypes.c_float)]
    assert c_header.prototypes(text) == {
        "f": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int], None), "g": ([], ctypes.c_int)}
    with pytest.raises(ValueError, match="double"):
        c_header.prototypes("int h(double x);")
    from kernels import cpu_decoder

    assert cpu_decoder._Shape is cpu_build.STRUCTS["decoder_shape"]
    assert [f for f, _ in cpu_decoder._Layer._fields_][:2] == ["input_norm", "post_norm"]
