"""The ctypes view of ``csrc/kernels.h``: its function prototypes as
(argument types, return type) and its ``typedef struct`` declarations as
``ctypes.Structure`` classes, so each C signature and struct is written once,
in the header, and the compiler checks every definition against it (each
.c file includes it).

The header keeps to a small subset of C, which this reads: one prototype or
typedef per statement, scalar types ``int64_t``, ``int``, ``float`` (and
``void`` returns), any pointer (passed as an address), fixed-size pointer
arrays in structs. Anything else raises ``ValueError`` rather than being
guessed.
"""

from __future__ import annotations

import ctypes
import re

SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^(int|void)\s+(\w+)\s*\(([^)]*)\)\s*;", re.M)
_STRUCT = re.compile(r"typedef\s+struct\s*\{([^}]*)\}\s*(\w+)\s*;", re.S)


def _code(text: str) -> str:
    """The header without comments and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"^\s*#.*$", "", text, flags=re.M)


def _scalar(ctype: str, where: str):
    base = ctype.replace("const", "").strip()
    if base not in SCALARS:
        raise ValueError(f"{where}: C type {ctype!r} has no ctypes mapping (pointers and {sorted(SCALARS)})")
    return SCALARS[base]


def prototypes(text: str) -> dict[str, tuple[list, type | None]]:
    """Every function prototype of a header: name -> (ctypes argument types, return type).

    Pointers map to ``c_void_p`` (the callers pass ``data_ptr()`` addresses or
    ``byref`` structs), scalars by ``SCALARS``, a ``void`` return to None.

    Raises:
        ValueError: an argument of a type with no mapping.
    """
    out = {}
    for ret, name, args in _PROTOTYPE.findall(_code(text)):
        argtypes = []
        for arg in (a.strip() for a in args.split(",")):
            if arg in ("", "void"):
                continue
            ctype = arg.rsplit("*", 1)[0] + "*" if "*" in arg else arg.rsplit(None, 1)[0]
            argtypes.append(ctypes.c_void_p if "*" in ctype else _scalar(ctype, f"{name}({arg})"))
        out[name] = (argtypes, None if ret == "void" else _scalar(ret, name))
    return out


def structs(text: str) -> dict[str, type[ctypes.Structure]]:
    """Every ``typedef struct { ... } name;`` of a header as a ``ctypes.Structure``
    subclass of that name, its fields in declaration order (``T *a, *b;`` and
    ``T *a[4];`` allowed).

    Raises:
        ValueError: a field of a type with no mapping.
    """
    out = {}
    for body, name in _STRUCT.findall(_code(text)):
        fields = []
        for decl in (d.strip() for d in body.split(";")):
            if not decl:
                continue
            m = re.match(r"((?:const\s+)?\w+)\s*(.*)$", decl, re.S)
            base, declarators = m.group(1), m.group(2)
            for d in (x.strip() for x in declarators.split(",")):
                dm = re.fullmatch(r"(\*?)\s*(\w+)\s*(?:\[(\d+)\])?", d)
                if dm is None:
                    raise ValueError(f"struct {name}: cannot read field {d!r}")
                star, field, count = dm.groups()
                ctype = ctypes.c_void_p if star else _scalar(base, f"struct {name}.{field}")
                fields.append((field, ctype * int(count) if count else ctype))
        out[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"``{name}`` of kernels.h."})
    return out
