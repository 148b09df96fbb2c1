"""The `cadence` command's entry point, cheap to import.

Importing the command (trio, quart, mlx, the engine) takes about a second. A Ctrl-C
in that second raised KeyboardInterrupt out of the console script's own import line,
a traceback; here it exits 130 quietly, as a Ctrl-C does once the command runs.
"""

from __future__ import annotations


def main() -> int:
    try:
        from actors.cli import main as run_command
    except KeyboardInterrupt:
        return 130
    return run_command()
