"""The `cadence` command's entry point: cheap to import, and quiet when Ctrl-C cuts its imports."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Interrupts the import of quart, which the command needs and the entry point must not,
# as a Ctrl-C arriving during the command's second of imports would.
INTERRUPTED_IMPORT = """
import sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "quart":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
from actors.entry import main
sys.argv = ["cadence", "--help"]
sys.exit(main())
"""


def _python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_the_installed_command_starts_at_the_entry_point() -> None:
    (script,) = entry_points(group="console_scripts", name="cadence")
    assert script.value == "actors.entry:main"


def test_importing_the_entry_point_imports_no_command() -> None:
    out = _python(
        "import sys, actors.entry\n"
        "print(sorted(m for m in ('actors.cli', 'actors.service', 'trio', 'quart', 'mlx.core')"
        " if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_ctrl_c_during_imports_exits_130_without_a_traceback() -> None:
    out = _python(INTERRUPTED_IMPORT)
    assert (out.returncode, out.stderr) == (130, "")


def test_the_entry_point_runs_the_command() -> None:
    out = _python(
        "import sys\nfrom actors.entry import main\nsys.argv = ['cadence', '--help']\nsys.exit(main())"
    )
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout
