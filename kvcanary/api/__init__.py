"""The public launches (``launches``: ``plan``, ``write``, ``verify``, re-exported by
:mod:`kvcanary`) and the copy of a launch's arguments to the other array library
(``transfer``) when ``backend=`` names it.

What it may import: README.md beside this file."""
