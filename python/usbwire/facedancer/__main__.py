"""``python3 -m usbwire.facedancer [--socket PATH] SCRIPT [ARGS] | -m MODULE [ARGS]``:
runs a Facedancer script with the usbwire backend registered and chosen (BACKEND=usbwire)."""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python3 -m usbwire.facedancer [--socket PATH] SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list) -> None:
    if argv[:1] == ["--socket"] and len(argv) >= 2:
        os.environ["USBWIRE_DEVICE_SOCKET"] = argv[1]
        argv = argv[2:]
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        sys.exit(USAGE)
    os.environ["BACKEND"] = "usbwire"
    import usbwire.facedancer  # noqa: F401  (registers the backend before the script picks one)

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
