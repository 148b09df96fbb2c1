"""The CLI's argparse types, each at its bounds: a value one past is refused."""

from __future__ import annotations

import argparse
import os

import pytest

from actors import arg_types


def refused(check, text, said=None):
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        check(text)
    return True


def test_integers_are_taken_at_their_bounds_and_refused_one_past():
    assert arg_types.positive_int("1") == 1 and refused(arg_types.positive_int, "0")
    assert arg_types.non_negative_int("0") == 0 and refused(arg_types.non_negative_int, "-1")
    assert refused(arg_types.positive_int, "1.5") and refused(arg_types.integer, "x")
    assert arg_types.port("0") == 0 and arg_types.port("65535") == 65535
    assert refused(arg_types.port, "65536") and refused(arg_types.port, "-1")


def test_numbers_are_finite_and_taken_at_their_bounds():
    assert arg_types.fraction("0") == 0 and arg_types.fraction("1") == 1
    assert refused(arg_types.fraction, "1.0001") and refused(arg_types.fraction, "-0.1")
    assert arg_types.non_negative_float("0") == 0 and refused(arg_types.non_negative_float, "-1e-9")
    assert arg_types.positive_float("1e-9") == 1e-9 and refused(arg_types.positive_float, "0")
    for bad in ("inf", "-inf", "nan", "x"):
        assert refused(arg_types.non_negative_float, bad)


def test_a_url_needs_an_http_scheme_a_host_and_a_port_in_range():
    assert arg_types.http_url("http://gpu-box:12345") == "http://gpu-box:12345"
    assert arg_types.http_url("https://gpu-box/v1") == "https://gpu-box/v1"
    for bad in ("gpu-box:12345", "http://", "ftp://gpu-box", "http://gpu-box:99999"):
        assert refused(arg_types.http_url, bad)


def test_a_host_is_neither_blank_nor_unencodable():
    assert arg_types.host("::1") == "::1"
    for bad in ("", "  ", "bad\udcffname"):
        assert refused(arg_types.host, bad)


def test_an_output_file_is_a_writable_place_for_a_new_file(tmp_path, monkeypatch):
    assert arg_types.output_file(str(tmp_path / "out.json")) == tmp_path / "out.json"
    assert arg_types.output_file("/dev/null") == arg_types.Path("/dev/null")  # written as is
    assert refused(arg_types.output_file, "", "not a file name")
    assert refused(arg_types.output_file, str(tmp_path), "is a directory")
    assert refused(arg_types.output_file, str(tmp_path / "no" / "out.json"), "no directory")
    # What is checked for write access: the directory a new file goes in, or a device
    # itself (written as it is). (A real read-only directory would not do: root writes anywhere.)
    monkeypatch.setattr(arg_types.os, "access", lambda path, mode: not os.path.isdir(path))
    assert refused(arg_types.output_file, str(tmp_path / "out.json"))
    assert arg_types.output_file("/dev/null") == arg_types.Path("/dev/null")
