"""The CADENCE_* environment variables, checked once at load.

Each is read where it acts (kernels/, the engine, the CLI), and each reader ignores what it
cannot use, so that a typo never fails a step. But a name or value mistyped
(`CADENCE_CPU_KERNEL=off`, `CADENCE_PAGED_ATTENTION=nativ`) then measures the default while
the user believes it measures their setting: `environment_problems` names every such one,
and `load_model` logs each as a warning.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping

_SWITCH = ("on", "off", "1", "0", "yes", "no")


def _one_of(*choices: str) -> Callable[[str], bool]:
    """In any case, as their readers compare (`.lower()`); a blank around it is no
    choice, since those readers strip none ("off " left the kernels on)."""
    return lambda value: value.lower() in choices


def _one_of_stripped(*choices: str) -> Callable[[str], bool]:
    """In any case, blanks around it read past, as CADENCE_PAGED_ATTENTION's reader does."""
    return lambda value: value.strip().lower() in choices


def _exactly(*choices: str) -> Callable[[str], bool]:
    return lambda value: value in choices


def _integer(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _whole_number(value: str) -> bool:
    return value.isascii() and value.isdecimal()  # the C++ readers take no other digits


def _positive_number(value: str) -> bool:
    return _whole_number(value) and int(value) > 0


# name -> (does the reader use this value?, what it takes)
KNOBS: dict[str, tuple[Callable[[str], bool], str]] = {
    "CADENCE_API_KEY": (lambda value: bool(value), "an API key"),
    "CADENCE_BLAS": (_one_of("reference", ""), "'reference' or unset"),
    "CADENCE_BUILD_KERNELS": (_exactly("0", "1", ""), "0 or 1 (read at install)"),
    "CADENCE_CPU_BLOCKS": (_one_of(*_SWITCH), "on or off"),
    "CADENCE_CPU_ISA": (_exactly("baseline", "avx2", "avx512"), "baseline, avx2 or avx512"),
    "CADENCE_CPU_KERNELS": (_one_of(*_SWITCH), "on or off"),
    "CADENCE_CPU_SPIN_US": (_whole_number, "microseconds, 0 or more"),
    "CADENCE_CPU_THREADS": (_positive_number, "a thread count, 1 or more"),
    "CADENCE_FAULT_TOKEN": (lambda value: re.fullmatch(r"\s*-?\d+(:\d+)?\s*", value) is not None,
                            "a token id N, or N:K"),
    "CADENCE_HUGE_PAGES": (_one_of(*_SWITCH), "on or off"),
    "CADENCE_PAGED_ATTENTION": (_one_of_stripped("gather", "fast", "native", ""), "gather, fast or native"),
    "CADENCE_PAGED_FAST_MIN_KEYS": (_integer, "a key count"),
}


def environment_problems(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One line for each CADENCE_* variable that is set but that nothing will use as given."""
    problems = []
    for name in sorted(key for key in environ if key.startswith("CADENCE_")):
        value = environ[name]
        if name not in KNOBS:
            problems.append(f"{name} is not a cadence setting and is ignored ({_closest(name)})")
        elif not KNOBS[name][0](value):
            problems.append(f"{name}={value!r} is not {KNOBS[name][1]}; cadence may not use it as meant")
    return problems


def _closest(name: str) -> str:
    """The known name a typo most likely meant."""
    match = difflib.get_close_matches(name, KNOBS, n=1, cutoff=0.8)
    return f"did you mean {match[0]}?" if match else "the README lists the settings"
