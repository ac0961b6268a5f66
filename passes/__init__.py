"""The pass manager and every pass, one module per pass or pass family."""

import importlib
import pkgutil

_loaded = False


def load_all() -> None:
    """Import every pass module so each registers its passes."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
