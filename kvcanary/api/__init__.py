"""The public launches (``launches``: ``plan``, ``write``, ``verify``, re-exported by
:mod:`kvcanary`) and the copy of a launch's arguments to the other array library
(``transfer``) when ``backend=`` names it.

It may import the layers below it: :mod:`kvcanary.backends`, :mod:`kvcanary.model`,
:mod:`kvcanary.format`, :mod:`kvcanary.system`."""
