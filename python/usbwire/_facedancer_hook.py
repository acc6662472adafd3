"""Run at interpreter start-up (``usbwire-facedancer.pth``): with ``BACKEND=usbwire`` in the
environment, importing ``facedancer`` also registers the usbwire backend, which Facedancer
finds only among the backend classes already imported. Without it, nothing happens.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Optional, Sequence


class _AfterFacedancer(importlib.abc.MetaPathFinder):
    """Finds ``facedancer`` as usual, then imports ``usbwire.facedancer`` once it has run."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target=None):  # type: ignore[no-untyped-def]
        if name != "facedancer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run_package = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run_package(module)
            import usbwire.facedancer  # noqa: F401  (registers the backend class)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("BACKEND", "").lower() == "usbwire" and "facedancer" not in sys.modules:
    sys.meta_path.insert(0, _AfterFacedancer())
