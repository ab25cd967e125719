"""Why a test did not run, in the words of someone running the suite: what is missing and
how to get it (tests/test_skip_reasons.py keeps every reason free of the suite's internals)."""

REPORT = "the HTML report needs jinja2: pip install 'kvcanary[report]'"
SAFETENSORS = "safetensors is not installed: pip install 'kvcanary[test]' has it"
SERVE = "needs the serve extra: pip install 'kvcanary[serve]'"


def transformers_extra(package: str) -> str:
    """A package of the transformers extra (torch, transformers, psutil) is missing."""
    return f"needs {package} (pip install 'kvcanary[transformers]')"
