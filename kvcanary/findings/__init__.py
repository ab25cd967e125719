"""What a ring row means: the evidence tables of a batch (``evidence``), the cause they
support (``diagnosis``), and a launch's rows tied to (request, position) and merged across
launches (``attribution``).

It may import the layers below it: :mod:`kvcanary.api`, :mod:`kvcanary.backends`,
:mod:`kvcanary.model`, :mod:`kvcanary.format`, :mod:`kvcanary.system`."""
