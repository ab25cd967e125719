"""Shared test set-up: makes ``tests/builders.py`` and ``tests/oracle.py`` importable as
``builders`` and ``oracle`` whatever pytest's import mode."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
