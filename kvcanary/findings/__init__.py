"""What a ring row means: the one vocabulary of causes (``causes``), the evidence tables of a
batch (``evidence``), the cause they support (``diagnosis``), and a launch's rows tied to
(request, position) and merged across launches (``attribution``).

What it may import: README.md beside this file."""
