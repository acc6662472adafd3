#!/usr/bin/env python3
"""What ships (issue 13 items 4 and 5), checked on the release binary: small,
no system font libraries, `-V` names the commit, shell completions load, the
man pages generated from the command line render with `man`; and the
systemd units in contrib/ score at most 5.0 in `systemd-analyze security`
(offline), their sysusers.d file creates the server's user, and the udev
rule gives its group the usbfs nodes.

    USBWIRE_BIN=target/release/usbwire python3 tests/interop/test_packaging.py
"""

import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN
CONTRIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "contrib")
MAX_EXPOSURE = 5.0
MAX_BYTES = 20 << 20
FONT_LIBRARIES = ("libfontconfig", "libfreetype", "libpng", "libbrotli", "libexpat")


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def main():
    guest.require(BIN)
    checks = guest.Checks()
    size = os.path.getsize(BIN)
    checks.check(f"release binary is at most 20 MiB ({size / (1 << 20):.1f} MiB)", size <= MAX_BYTES, size)
    linked = run(["ldd", BIN]).stdout
    found = [lib for lib in FONT_LIBRARIES if lib in linked]
    checks.check("no font or image library linked", not found, linked)

    version = run([BIN, "-V"]).stdout.strip()
    checks.check("-V names the commit", re.fullmatch(r"usbwire \S+ \([0-9a-f]{12}(-dirty)?\)", version) is not None,
                 version)

    loaded = run(["bash", "-c", f"source <({BIN} completions bash) && complete -p usbwire"])
    checks.check("bash completion loads", loaded.returncode == 0 and "usbwire" in loaded.stdout,
                 loaded.stdout + loaded.stderr)
    # What bash would offer after `usbwire re`: the function the script registered, run as bash would.
    offered = run(["bash", "-c", f"source <({BIN} completions bash); COMP_WORDS=(usbwire re); COMP_CWORD=1; "
                   "COMP_LINE='usbwire re'; COMP_POINT=10; _usbwire usbwire re usbwire; echo \"${COMPREPLY[@]}\""])
    checks.check("bash completes `usbwire re` to redir", "redir" in offered.stdout.split(),
                 offered.stdout + offered.stderr)
    for shell in ("zsh", "fish"):
        script = run([BIN, "completions", shell])
        checks.check(f"{shell} completion script", script.returncode == 0 and "redir" in script.stdout, script.stderr)

    with tempfile.TemporaryDirectory() as man_dir:
        written = run([BIN, "man", "--dir", man_dir])
        pages = sorted(os.listdir(man_dir))
        checks.check("man --dir writes usbwire.1 and a page per command",
                     written.returncode == 0 and "usbwire.1" in pages and "usbwire-serve.1" in pages
                     and "usbwire-redir.1" in pages, f"{pages} {written.stderr}")
        env = dict(os.environ, MANPAGER="cat", PAGER="cat", MANWIDTH="100")
        for page, wanted in [("usbwire.1", "redir"), ("usbwire-serve.1", "--metrics")]:
            shown = run(["man", "-l", os.path.join(man_dir, page)], env=env)
            text = re.sub(r".\x08", "", shown.stdout)
            checks.check(f"man -l {page} renders", shown.returncode == 0 and wanted in text,
                         shown.stderr + text[:400])
    check_systemd(checks)
    checks.exit()


def check_systemd(checks):
    for unit in ("usbwire-server.service", "usbwire-client.service"):
        path = os.path.join(CONTRIB, "systemd", unit)
        out = run(["systemd-analyze", "security", "--offline=true", path])
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
        exposure = float(found.group(1)) if found else 99.0
        checks.check(f"{unit}: systemd-analyze security exposure {exposure} <= {MAX_EXPOSURE}",
                     exposure <= MAX_EXPOSURE, out.stdout[-1500:] + out.stderr)
        text = open(path).read()
        checks.check(f"{unit}: Type=notify and no restart loop on a bad command line or config",
                     "Type=notify" in text and "RestartPreventExitStatus=64 78" in text, text)
    server = open(os.path.join(CONTRIB, "systemd", "usbwire-server.service")).read()
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "etc"))
        made = run(["systemd-sysusers", f"--root={root}", os.path.join(CONTRIB, "sysusers.d", "usbwire.conf")])
        passwd = open(os.path.join(root, "etc", "passwd")).read() if made.returncode == 0 else ""
        checks.check("sysusers.d creates the user the server's unit runs as",
                     re.search(r"^usbwire:x:\d+:\d+:", passwd, re.M) is not None and "User=usbwire" in server,
                     made.stdout + made.stderr + passwd)
    rules = open(os.path.join(CONTRIB, "udev", "70-usbwire.rules")).read()
    checks.check("the udev rule gives that group the usbfs nodes the unit allows",
                 'GROUP="usbwire"' in rules and "DeviceAllow=char-usb_device rw" in server, rules)


if __name__ == "__main__":
    main()
