"""What kvcanary asks of the operating system: ``signals`` (stopping at once on Ctrl-C or
SIGTERM, worker processes that stop with their parent) and ``atomic`` (whole-or-nothing
files and directories).

It imports no other part of kvcanary."""
