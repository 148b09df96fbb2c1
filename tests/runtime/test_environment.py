"""The CADENCE_* settings: a mistyped name or value is named at load, not silently measured."""

import re
from pathlib import Path

from runtime.checkpoint import load_model
from runtime.environment import KNOBS, environment_problems

from structlog.testing import capture_logs

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_the_code_reads_is_known():
    """A setting added without its entry would warn every user who sets it."""
    read = set()
    sources = [*ROOT.glob("runtime/**/*.py"), *ROOT.glob("actors/**/*.py"), *ROOT.glob("kernels/**/*.py"),
               *ROOT.glob("kernels/cpu/*.cpp"), ROOT / "setup.py"]
    for source in sources:
        if source.name == "environment.py":  # its docstring quotes typos
            continue
        read |= set(re.findall(r"\b(CADENCE_[A-Z_]+[A-Z])\b", source.read_text()))
    compile_time = {name for name in read if name.startswith(("CADENCE_DECLARE_", "CADENCE_HAS_"))}
    compile_time |= {"CADENCE_ISA", "CADENCE_LANES", "CADENCE_STR"}  # C++ macros, not settings
    assert read - compile_time == set(KNOBS)


def test_good_settings_raise_nothing():
    environ = {"CADENCE_CPU_KERNELS": "off", "CADENCE_PAGED_ATTENTION": "native", "CADENCE_CPU_ISA": "avx2",
               "CADENCE_CPU_THREADS": "2", "CADENCE_CPU_SPIN_US": "0", "CADENCE_FAULT_TOKEN": "5:2",
               "CADENCE_PAGED_FAST_MIN_KEYS": "4096", "CADENCE_API_KEY": "k", "HOME": "/root"}
    assert environment_problems(environ) == []


def test_a_mistyped_name_is_named_with_the_one_it_likely_meant():
    [problem] = environment_problems({"CADENCE_CPU_KERNEL": "off"})
    assert "CADENCE_CPU_KERNEL is not a cadence setting" in problem
    assert "did you mean CADENCE_CPU_KERNELS?" in problem
    [problem] = environment_problems({"CADENCE_WHATEVER": "1"})
    assert "did you mean" not in problem


def test_a_value_its_reader_would_not_use_is_named():
    cases = {
        "CADENCE_PAGED_ATTENTION": "nativ",
        "CADENCE_CPU_ISA": "AVX2",  # the C++ reader compares exactly
        "CADENCE_CPU_THREADS": "0",
        "CADENCE_CPU_SPIN_US": "-5",
        "CADENCE_CPU_KERNELS": "of",  # would leave the kernels on
        "CADENCE_HUGE_PAGES": "off ",  # its reader strips no blank: the pages stayed on
        "CADENCE_CPU_BLOCKS": " no",
        "CADENCE_BLAS": "reference\n",
        "CADENCE_BUILD_KERNELS": "off",  # only "0" skips the build
        "CADENCE_FAULT_TOKEN": "x",
    }
    problems = environment_problems(cases)
    for (name, value), problem in zip(sorted(cases.items()), problems, strict=True):
        assert problem.startswith(f"{name}={value!r} is not ")
    # The line names what its reader takes.
    assert environment_problems({"CADENCE_PAGED_ATTENTION": "nativ"}) == [
        "CADENCE_PAGED_ATTENTION='nativ' is not gather, fast or native; cadence may not use it as meant"
    ]


def test_a_number_in_other_digits_is_named_and_blanks_only_where_the_reader_keeps_them():
    [problem] = environment_problems({"CADENCE_CPU_THREADS": "\u0664"})  # C++'s atoi reads no digit in it
    assert problem.startswith("CADENCE_CPU_THREADS='\u0664' is not ")
    for value in (" Fast\n", "GATHER", "native", ""):  # its reader strips and lowers
        assert environment_problems({"CADENCE_PAGED_ATTENTION": value}) == [], value


def test_loading_logs_each_problem_as_a_warning(monkeypatch):
    monkeypatch.setenv("CADENCE_HUGE_PAGE", "off")
    with capture_logs() as logs:
        load_model()
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert [entry["problem"] for entry in warnings] == [
        "CADENCE_HUGE_PAGE is not a cadence setting and is ignored (did you mean CADENCE_HUGE_PAGES?)"
    ]
