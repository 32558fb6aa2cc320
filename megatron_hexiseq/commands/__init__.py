"""The ``megatron-hexiseq`` commands, one module each (see ``megatron_hexiseq.cli``)."""


def describe(doc: str | None) -> str:
    """A command module's docstring as ``--help`` shows it: no ``name``: prefix, no RST markup."""
    import re

    text = (doc or "").strip()
    text = re.sub(r"^``[^`]*``:\s*", "", text)
    text = re.sub(r"``([^`]*)``", r"'\1'", text)
    return text[:1].upper() + text[1:]
