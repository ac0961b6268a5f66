"""The pass manager and every pass, one module per pass or pass family.

Passes are registered by name with their module (`manager.PASS_MODULES`); a pipeline imports the
module of a pass the first time it names it.
"""


def load_all() -> None:
    """Import the module of every registered pass, as listing the passes with their summaries needs."""
    from .manager import pass_class, pass_names

    for name in pass_names():
        pass_class(name)
