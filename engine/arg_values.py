"""The values engine flags and settings take, parsed: token counts (``4k``), TCP ports, durations, memory sizes
(``2GiB``), and ``flag_type``, which makes a parser an ``argparse`` type. Shared by ``engine.config`` and the
gateway's own flags and schema."""

from __future__ import annotations

import argparse


def parse_token_count(value: int | str) -> int:
    """A token count as vLLM's flags take it (``human_readable_int``): ``4096``, ``4k`` (x 1000), ``4K`` (x 1024),
    also ``m``/``M`` and ``g``/``G``; ``25.6k`` = 25,600.

    Raises:
        ValueError: unparseable, or not a whole number of tokens."""
    text = str(value).strip()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if mult != 1 else text
    try:
        count = float(number) * mult
    except ValueError:
        raise ValueError(f"cannot parse a token count from {value!r} (e.g. 4096, 4k, 4K)") from None
    if not count.is_integer():
        raise ValueError(f"a token count must be a whole number, got {value!r}")
    return int(count)


def tcp_port(value: str) -> int:
    """A ``--port`` flag's value: 0 (any free port) to 65535.

    Raises:
        ValueError: not an integer in that range (a larger one would be taken modulo 65536 by the socket)."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"a TCP port is 0-65535, got {port}")
    return port


def _count_from(low: int, word: str):
    def count(value: str) -> int:
        n = int(value)
        if n < low:
            raise ValueError(f"must be {word}, got {n}")
        return n
    return count


# A count flag's value (``--num-prompts``, ``--rounds``): an integer, 1 or more (a benchmark of no prompts or
# rounds printed nan and exited 0). Raises ValueError: not an integer, or below 1.
positive_count = _count_from(1, "at least 1")
# A count flag whose 0 means off (``--compare-batch-invariant ROUNDS``): an integer, 0 or more. Raises ValueError.
non_negative_count = _count_from(0, "0 (off) or more")


def positive_seconds(value: str) -> float:
    """A duration flag that must pass (``--duration``): seconds, more than 0.

    Raises:
        ValueError: not a number, or 0 or less."""
    seconds = float(value)
    if not seconds > 0:   # also refuses nan
        raise ValueError(f"must be > 0 seconds, got {value}")
    return seconds


def non_negative_seconds(value: str) -> float:
    """A duration flag's value (``--drain-timeout``): seconds, 0 or more.

    Raises:
        ValueError: not a number, or negative (a negative wait would end the drain before it starts)."""
    seconds = float(value)
    if not seconds >= 0:   # also refuses nan
        raise ValueError(f"must be >= 0 seconds, got {value}")
    return seconds


def parse_size(value: int | float | str) -> int:
    """Parse a memory size into bytes: ``1073741824``, ``"512MiB"``, ``"2GiB"``,
    ``"1.5G"`` (binary units: K/M/G/T and KB/MB/GB/TB = KiB/MiB/GiB/TiB, as vLLM's sizes).

    Raises:
        ValueError: unparseable or negative.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"memory size must be >= 0, got {value}")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    units = {"tib": 2**40, "tb": 2**40, "t": 2**40, "gib": 2**30, "gb": 2**30, "g": 2**30,
             "mib": 2**20, "mb": 2**20, "m": 2**20, "kib": 2**10, "kb": 2**10, "k": 2**10, "b": 1}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        number, mult = text, 1
    try:
        size = float(number) * mult
    except ValueError:
        raise ValueError(f"cannot parse memory size {value!r} (e.g. 2GiB, 512MiB)") from None
    if size < 0:
        raise ValueError(f"memory size must be >= 0, got {value!r}")
    return int(size)


def flag_type(parse):
    """``parse`` as an ``argparse`` type: its ValueError's message becomes the flag's error."""
    def typed(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    typed.__name__ = parse.__name__
    return typed
