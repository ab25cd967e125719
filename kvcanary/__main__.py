"""``python -m kvcanary``: the same command line as the ``kvcanary`` entry point."""

from kvcanary.cli import main

if __name__ == "__main__":
    main(prog_name="kvcanary")
