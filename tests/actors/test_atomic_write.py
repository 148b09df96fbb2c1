"""Reports written whole or not at all (bench serve --json, bench soak --json, trace timeline -o)."""

from pathlib import Path

import pytest

from actors.atomic_write import write_atomically


def test_a_write_that_fails_midway_leaves_the_earlier_file_whole_and_no_litter(tmp_path):
    """A full disk truncated the earlier run's JSON in place: both results were lost."""
    report = tmp_path / "result.json"
    report.write_text('{"earlier": true}')

    def half_then_full_disk(temporary):
        temporary.write_text('{"later": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomically(report, half_then_full_disk)
    assert report.read_text() == '{"earlier": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_write_replaces_the_file_or_a_links_target_keeping_the_suffix(tmp_path):
    target = tmp_path / "kept.svg"
    target.write_text("old")
    link = tmp_path / "link.svg"
    link.symlink_to(target)
    suffixes = []

    def write(temporary):
        suffixes.append(temporary.suffix)  # matplotlib reads the format from it
        temporary.write_text("new")

    write_atomically(link, write)
    assert link.is_symlink() and target.read_text() == "new" and suffixes == [".svg"]
    write_atomically(tmp_path / "fresh.png", write)
    assert (tmp_path / "fresh.png").read_text() == "new"


def test_a_device_is_written_as_it_is_never_renamed_over(tmp_path):
    """/dev/full as the report (the bench tests' full disk): renamed over, the device
    would have become a file."""
    with pytest.raises(OSError, match="No space"):
        write_atomically(Path("/dev/full"), lambda path: path.write_text("x"))
    assert Path("/dev/full").is_char_device()
    assert not list(Path("/dev").glob(".full.*"))
