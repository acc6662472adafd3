#!/usr/bin/env python3
"""A lab of many servers on etcd (issue 14): a 3-member etcd cluster (Debian's
etcd-server) on loopback ports and 6 `usbwire serve` instances registered in
it, each with virtual devices and labels.

- The registry is not trusted to name servers (issue 20): entries planted
  through etcd's JSON gateway, as anyone who can write to etcd could, are
  refused by the guest's `attach --registry` with exit 69 and the reason: a
  plain server's entry (no TLS key), and an entry naming the guest-disk
  server's key for an intruder's TLS server; nothing is attached and the
  reservations are given back.
- A vhci-hcd guest gets a disk by `usbwire attach --registry … --device
  label=guestdisk` without knowing the server (a TLS server: the attach pins
  the key in its registry entry, with no --trust-new): the disk's first sector reads
  back the host's marker; while attached, `who` shows the reservation held
  by `usbwire attach`; detach gives it back. Then `usbwire client` with a
  `server = "registry"` rule attaches it, reserved, until SIGTERM.
- `list --registry --json` shows every server and device with labels (`--json-lines`
  the same, one object a line), and
  `list --registry --device label=nucleo` exactly those labelled so;
  `list --registry --watch --json` follows the changes live.
- 20 clients race (`usbwire reserve --for`) for the 10 devices labelled
  `nucleo`: each device is held by exactly one client, the other ten are told
  that none is free (exit 75); a reserved device refuses a direct import;
  released, all ten are reserved again at once.
- A quiet fleet stays quiet (issue 18): while a client holds a device with
  `usbwire reserve` (no --for) for 3 of its leases' times to live (30 s),
  nobody else can take it, `list --registry --watch` prints no change, the
  servers (ttl 4 s) log no lost connection, and each server keeps the lease
  it registered under at the start, as does the client.
- kill -9 a holding client (`usbwire reserve` without --for): its device is
  free again within the lease's time to live (10 s).
- kill -9 a server: gone from the registry within its ttl (4 s).
- Stop one etcd member: reservations and the fleet view still work.
- Stop the whole cluster: servers keep serving devices directly, a client
  says the registry is unreachable (exit 69); start it again: the servers
  register again by themselves.
- etcd with TLS and client certificates (openssl-made CA): a server
  registers with `[registry] ca/cert/key`, `list --registry-ca/-cert/-key`
  reads it, a client without a certificate is refused; with that etcd
  frozen (SIGSTOP), a server stopped with SIGTERM still exits at once.
- SIGTERM a server: its devices are gone from `list --registry` within 1 s
  (it revokes its lease on the way out).

Run: python3 tests/interop/test_lab.py   (USBWIRE_BIN=path/to/usbwire)
"""

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402

BIN = guest.BIN
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SERVER_TTL = 4
CLIENT_TTL = 10
# Slack on top of a time to live: etcd checks leases every 500 ms, and the test polls.
SLACK = 3.0
MARKER = b"USBWIRE-LAB-MARKER"

GUEST_SCRIPT = r"""
set -u
export XDG_STATE_HOME=/tmp/state
# Planted entries: a plain server, and an intruder's TLS server under the guest disk server's key.
timeout 60 usbwire attach --registry __REGISTRY__ --device label=planted-plain > /tmp/planted1.out 2>&1; rc=$?
[ $rc = 69 ] && grep -q "plain USB/IP server" /tmp/planted1.out && grep -q -- "--allow-plain" /tmp/planted1.out
check planted-plain-entry-refused $? "exit $rc: $(tr '\n' '|' < /tmp/planted1.out)"
timeout 60 usbwire attach --registry __REGISTRY__ --device label=planted-tls > /tmp/planted2.out 2>&1; rc=$?
[ $rc = 69 ] && grep -q "but its lab registry entry names" /tmp/planted2.out
check planted-wrong-key-refused $? "exit $rc: $(tr '\n' '|' < /tmp/planted2.out)"
[ "$(usbwire port | grep -c '^Port')" = 0 ]; check nothing-attached-from-planted-entries $? "$(usbwire port | tr '\n' '|')"
echo "@@PLANTED-OUT $(tr '\n' '|' < /tmp/planted1.out) $(tr '\n' '|' < /tmp/planted2.out)"
echo "@@PLANTED-DONE"
timeout 90 usbwire attach --registry __REGISTRY__ --device label=guestdisk > /tmp/attach.out 2>&1
check attach-by-registry $? "$(tr '\n' '|' < /tmp/attach.out)"
echo "@@ATTACH-OUT $(tr '\n' '|' < /tmp/attach.out)"
wait_for '[ -e /sys/block/sda ]' 600; check disk-appears $?
sleep 1
dd if=/dev/sda bs=512 count=1 2>/dev/null | grep -q USBWIRE-LAB-MARKER; check marker-reads-back $?
echo "@@HELD"
i=0; while ! nc -w 2 10.0.2.2 __GO__ </dev/null >/dev/null 2>&1 && [ $i -lt 120 ]; do sleep 1; i=$((i+1)); done
PORT=$(sed -n 's/.* port \([0-9][0-9]*\).*/\1/p' /tmp/attach.out | head -n 1)
usbwire detach -p "$PORT"; check detach $?
wait_for '[ ! -e /sys/block/sda ]' 300; check disk-gone $?
echo "@@DETACHED"
# The service: a server = "registry" rule keeps a labelled device attached, reserved.
mkdir -p /etc/usbwire
cat > /etc/usbwire/client.toml <<EOF
[registry]
endpoints = [__ENDPOINTS__]
prefix = "__PREFIX__"

[[attach]]
server = "registry"
device = "class=08"
labels = ["guestdisk"]
EOF
usbwire client --config /etc/usbwire/client.toml > /tmp/client.log 2>&1 &
CLIENT=$!
wait_for '[ -e /sys/block/sda ]' 600; check service-attaches-by-registry $? "$(tail -n 3 /tmp/client.log | tr '\n' '|')"
echo "@@SERVICE-HELD"
i=0; while ! nc -w 2 10.0.2.2 __GO2__ </dev/null >/dev/null 2>&1 && [ $i -lt 120 ]; do sleep 1; i=$((i+1)); done
kill -TERM $CLIENT; wait $CLIENT; check service-stops $?
wait_for '[ ! -e /sys/block/sda ]' 300; check service-detached $?
echo "@@SERVICE-DONE"
# A person's reservation first (reserve --for), then attach uses it rather than taking another.
R=__REGISTRY__
usbwire reserve --registry $R --device label=guestdisk --for 5m > /tmp/reserve.out 2>&1; check reserve-for $? "$(cat /tmp/reserve.out)"
timeout 90 usbwire attach --registry $R --device label=guestdisk > /tmp/attach2.out 2>&1
check attach-uses-the-reservation $? "$(tr '\n' '|' < /tmp/attach2.out)"
wait_for '[ -e /sys/block/sda ]' 600; check disk-appears-again $?
n=$(usbwire who --registry $R --json | grep -o '"client": *"usbwire reserve"' | wc -l)
m=$(usbwire who --registry $R --json | grep -o '"client": *"usbwire attach"' | wc -l)
[ "$n" = 1 ] && [ "$m" = 0 ]; check one-reservation-the-persons $? "reserve $n, attach $m"
PORT=$(sed -n 's/.* port \([0-9][0-9]*\).*/\1/p' /tmp/attach2.out | head -n 1)
usbwire detach -p "$PORT"; wait_for '[ ! -e /sys/block/sda ]' 300; check detached-again $?
usbwire release --registry $R --device label=guestdisk > /tmp/release.out 2>&1; check release-after $? "$(cat /tmp/release.out)"
echo "@@RESERVE-DONE"
exit 0
"""


def http_json(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


def leases(port, prefix):
    """Key -> lease id of every key under `prefix`, from etcd's JSON gateway on `port`."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    body = json.dumps({"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/range", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        kvs = json.loads(answer.read()).get("kvs", [])
    return {base64.b64decode(kv["key"]).decode(): int(kv.get("lease", 0)) for kv in kvs}


def gateway(port, call, body):
    """One request to etcd's JSON gateway on `port` (keys and values base64)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v3/{call}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


def b64(text):
    return base64.b64encode(text.encode()).decode()


def plant(port, prefix, server, fingerprint, busid, label):
    """Writes a server entry and one device (with its label's index entry) the way anyone who can
    write to etcd could, under no lease; returns the key prefixes to delete afterwards."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entry = {"schema_version": 1, "address": server, "tls_fingerprint": fingerprint, "plain": fingerprint is None,
             "implementation": "usbwire", "version": "0.1.0", "started_at": now}
    device = {"schema_version": 1, "server": server, "busid": busid, "kind": "keyboard", "vendor_id": "1209",
              "product_id": "0001", "manufacturer": None, "product": "planted keyboard", "serial": None,
              "class": "03", "interface_classes": [], "speed": "full", "state": "available", "holder": None,
              "since_at": None, "labels": [label]}
    for key, value in ((f"{prefix}/servers/{server}", json.dumps(entry)),
                       (f"{prefix}/devices/{server}/{busid}", json.dumps(device)),
                       (f"{prefix}/index/label/{label}/{server}/{busid}", "available")):
        gateway(port, "kv/put", {"key": b64(key), "value": b64(value)})
    return [f"{prefix}/servers/{server}", f"{prefix}/devices/{server}/", f"{prefix}/index/label/{label}/",
            f"{prefix}/reservations/{server}/"]


def unplant(port, prefixes):
    for prefix in prefixes:
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        gateway(port, "kv/deleterange", {"key": base64.b64encode(start).decode(),
                                         "range_end": base64.b64encode(end).decode()})


class Cluster:
    """Three etcd members on loopback, each in its own data directory."""

    def __init__(self, work):
        self.work = work
        self.client_ports = [guest.free_port() for _ in range(3)]
        self.peer_ports = [guest.free_port() for _ in range(3)]
        self.procs = [None, None, None]
        self.initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))

    def endpoints(self, host="127.0.0.1"):
        return ",".join(f"{host}:{p}" for p in self.client_ports)

    def start(self, i):
        log = open(os.path.join(guest.LOGS, f"lab.etcd{i}.log"), "a")
        client, peer = self.client_ports[i], self.peer_ports[i]
        # Clients in the guest come through QEMU's user network, from 127.0.0.1 too.
        self.procs[i] = subprocess.Popen(
            [ETCD, "--name", f"m{i}", "--data-dir", os.path.join(self.work, f"m{i}"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", self.initial, "--initial-cluster-state", "new", "--initial-cluster-token", "usbwire-lab-test"],
            stdout=log, stderr=subprocess.STDOUT)

    def start_all(self):
        for i in range(3):
            self.start(i)
        self.wait_healthy(range(3))

    def wait_healthy(self, members, timeout=60):
        deadline = time.time() + timeout
        for i in members:
            while True:
                try:
                    if http_json(f"http://127.0.0.1:{self.client_ports[i]}/health").get("health") == "true":
                        break
                except OSError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"etcd member {i} not healthy within {timeout} s (log {guest.LOGS}/lab.etcd{i}.log)")
                time.sleep(0.2)

    def stop(self, i):
        proc = self.procs[i]
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self):
        for i in range(3):
            self.stop(i)


class Servers:
    def __init__(self, work, registry_table, disk_image):
        self.work = work
        self.table = registry_table
        self.disk_image = disk_image
        self.procs = {}
        self.ports = {}
        self.logs = {}

    def config(self, n):
        port = self.ports[n]
        lines = [f'listen = "127.0.0.1:{port}"', "advertise = false", "resume_grace = 5", ""]
        if n == 5:
            # The guest's disk: registered under the address the guest reaches it by, over TLS
            # (its entry carries the key a registry attach pins); any client key is admitted.
            lines[-1:-1] = ["tls = true", f'identity = "{self.work}/id5"', "allow_any_client = true"]
            lines += ["[[allow]]", 'client = "*"', 'devices = ["*"]', ""]
            lines += ["[[virtual]]", 'kind = "disk"', f'path = "{self.disk_image}"', 'labels = ["guestdisk"]', ""]
        else:
            for d in range(2):
                lines += ["[[virtual]]", 'kind = "disk"', f'path = "{self.work}/s{n}-d{d}.img"', 'size = "1M"',
                          f'labels = ["nucleo", "bench-{n}"]', ""]
            lines += ["[[virtual]]", 'kind = "keyboard"', 'labels = ["kbd"]', ""]
        address = f"10.0.2.2:{port}" if n == 5 else f"127.0.0.1:{port}"
        lines += ["[registry]", self.table, f'address = "{address}"', f'ttl = "{SERVER_TTL}s"']
        return "\n".join(lines) + "\n"

    def start(self, n):
        self.ports.setdefault(n, guest.free_port())
        path = os.path.join(self.work, f"server{n}.toml")
        with open(path, "w") as f:
            f.write(self.config(n))
        self.logs[n] = os.path.join(guest.LOGS, f"lab.server{n}.log")
        self.procs[n] = subprocess.Popen([BIN, "serve", "--config", path, "--control", os.path.join(self.work, f"c{n}.sock")],
                                         stdout=open(self.logs[n], "w"), stderr=subprocess.STDOUT)

    def log(self, n):
        return open(self.logs[n], errors="replace").read()

    def wait_log(self, n, needle, timeout, count=1):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.log(n).count(needle) >= count:
                return True
            time.sleep(0.2)
        return False

    def stop_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def quiet_phase(checks, cluster, servers, registry, prefix, env, first_leases):
    """Issue 18: nothing changes in a fleet where nothing happens, for 3 of
    the holding client's times to live (30 s; 7 of the servers')."""
    def holds():
        return sorted((d["server"], d["busid"], d["reservation"]["holder"], d["reservation"]["since_at"])
                      for d in reserved(registry, env))
    held = holds()
    # Exactly the held device (its server has another that matches the holder's selector).
    device = f"server={held[0][0]},{held[0][1]}" if held else "label=bench-0,class=08"
    held_leases = leases(cluster.client_ports[1], f"{prefix}/reservations/")
    watch_log = os.path.join(guest.LOGS, "lab.quiet-watch.log")
    watcher = subprocess.Popen([BIN, "list", "--registry", registry, "--watch", "--json"], stdout=open(watch_log, "w"),
                               stderr=subprocess.STDOUT, env=env)
    try:
        started = wait_until(lambda: open(watch_log).read().startswith("{"), 10, step=0.1)
        checks.check("quiet fleet: list --watch shows the fleet", started is not None, open(watch_log).read()[-300:])
        refusals = []
        for _ in range(3):
            time.sleep(CLIENT_TTL)
            other = usbwire("reserve", "--registry", registry, "--device", device, "--for", "1m", env=env)
            refusals.append((other.returncode, other.stderr.strip()[-200:]))
        output = open(watch_log).read().splitlines()
    finally:
        watcher.terminate()
        watcher.wait(10)
    checks.check(f"quiet fleet: another client cannot take the held device in 3 tries over {3 * CLIENT_TTL} s (exit 75)",
                 all(rc == 75 for rc, _ in refusals), refusals)
    checks.check(f"quiet fleet: the client still holds it after 3 times to live ({3 * CLIENT_TTL} s), under the same lease",
                 len(held) == 1 and holds() == held and leases(cluster.client_ports[1], f"{prefix}/reservations/") == held_leases,
                 (held, held_leases))
    checks.check(f"quiet fleet: list --watch printed no change in {3 * CLIENT_TTL} s", len(output) == 1, output[1:6])
    lost = {n: [line for line in servers.log(n).splitlines() if "lost the lab registry" in line or "registered again" in line]
            for n in servers.procs}
    checks.check("quiet fleet: no server lost its registry connection or registered again since it started",
                 not any(lost.values()), {n: lines[:2] for n, lines in lost.items() if lines})
    now = leases(cluster.client_ports[1], f"{prefix}/servers/")
    checks.check("quiet fleet: every server is still under the lease it registered with at the start",
                 now == first_leases, (first_leases, now))
    keyed = leases(cluster.client_ports[1], f"{prefix}/devices/")
    # Catalog chunks (`devices/SERVER/!catalog/…`, `devices/SERVER/!term/KIND/TERM/…`, or a
    # `…/whole` marker for a term most of a server's devices have) beside the device keys.
    devices = {key: lease for key, lease in keyed.items() if "/!" not in key}
    chunks = {key: lease for key, lease in keyed.items() if "/!" in key}
    by_server = {key.rsplit("/", 1)[-1]: lease for key, lease in now.items()}
    checks.check("quiet fleet: and so is every device it registered",
                 len(devices) == 16 and all(by_server.get(key.split("/")[-2]) == lease for key, lease in devices.items()),
                 devices)
    chunk_server = lambda key: key.split("/devices/", 1)[1].split("/!", 1)[0]
    with_devices = {key.split("/")[-2] for key in devices}
    of_kind = lambda kind: {chunk_server(key) for key in chunks if f"/!{kind}/" in key}
    checks.check("quiet fleet: and so is each server's catalog of them, and of each label, VID:PID and class",
                 all(of_kind(kind) == with_devices for kind in ("catalog", "term/label", "term/id", "term/class"))
                 and all(by_server.get(chunk_server(key)) == lease for key, lease in chunks.items()),
                 chunks)


def make_certificates(work):
    """A CA, a certificate for etcd on 127.0.0.1, and a client certificate (openssl)."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=work)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=usbwire lab test CA")
    for name, usage, san in (("etcd", "serverAuth", "IP:127.0.0.1"), ("client", "clientAuth", "DNS:usbwire-client")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        with open(os.path.join(work, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return {name: os.path.join(work, name) for name in
            ("ca.crt", "etcd.crt", "etcd.key", "client.crt", "client.key")}


def tls_phase(checks, work, env):
    """One etcd member that speaks TLS and wants client certificates."""
    certs = make_certificates(work)
    client_port, peer_port = guest.free_port(), guest.free_port()
    log = open(os.path.join(guest.LOGS, "lab.etcd-tls.log"), "w")
    etcd = subprocess.Popen(
        [ETCD, "--name", "tls", "--data-dir", os.path.join(work, "tls"),
         "--listen-client-urls", f"https://127.0.0.1:{client_port}", "--advertise-client-urls", f"https://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"tls=http://127.0.0.1:{peer_port}",
         "--cert-file", certs["etcd.crt"], "--key-file", certs["etcd.key"],
         "--trusted-ca-file", certs["ca.crt"], "--client-cert-auth"],
        stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        time.sleep(2)
        port = guest.free_port()
        config = os.path.join(work, "server-tls.toml")
        with open(config, "w") as f:
            f.write(f'listen = "127.0.0.1:{port}"\nadvertise = false\n[[virtual]]\nkind = "keyboard"\n'
                    f'[registry]\nendpoints = ["127.0.0.1:{client_port}"]\nprefix = "tls-lab"\n'
                    f'ca = "{certs["ca.crt"]}"\ncert = "{certs["client.crt"]}"\nkey = "{certs["client.key"]}"\n')
        server_log = os.path.join(guest.LOGS, "lab.server-tls.log")
        server = subprocess.Popen([BIN, "serve", "--config", config, "--control", os.path.join(work, "ctls.sock")],
                                  stdout=open(server_log, "w"), stderr=subprocess.STDOUT)
        registered = wait_until(lambda: "registered in the lab registry" in open(server_log).read(), 20)
        checks.check("TLS etcd: a server registers with [registry] ca/cert/key", registered is not None,
                     open(server_log).read()[-400:])
        registry = f"etcd://127.0.0.1:{client_port}/tls-lab"
        listed = usbwire("list", "--registry", registry, "--registry-ca", certs["ca.crt"], "--registry-cert",
                         certs["client.crt"], "--registry-key", certs["client.key"], "--json", env=env)
        view = json.loads(listed.stdout) if listed.returncode == 0 else {}
        checks.check("TLS etcd: list --registry-ca/--registry-cert/--registry-key shows it",
                     len(view.get("servers", [])) == 1 and len(view.get("devices", [])) == 1,
                     (listed.returncode, listed.stderr.strip()[-300:]))
        refused = usbwire("list", "--registry", registry, "--registry-ca", certs["ca.crt"], env=env)
        checks.check("TLS etcd: a client without a certificate is refused (exit 69)",
                     refused.returncode == 69 and "unreachable" in refused.stderr, (refused.returncode, refused.stderr.strip()))
        # A registry that does not answer at all must not hold a stopping server up.
        etcd.send_signal(signal.SIGSTOP)
        sent = time.time()
        server.terminate()
        try:
            rc = server.wait(10)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.time() - sent
        print(f"  server stopped {took:.1f} s after SIGTERM with its etcd frozen", flush=True)
        checks.check("TLS etcd frozen (SIGSTOP): a server stopped with SIGTERM exits within 4 s", rc == 0 and took <= 4,
                     (rc, round(took, 1), open(server_log).read()[-300:]))
        etcd.send_signal(signal.SIGCONT)
    finally:
        if server:
            server.terminate()
            server.wait(10)
        etcd.terminate()
        etcd.wait(10)


def usbwire(*args, env=None, timeout=60):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout, env=env)


def fleet(registry, env):
    out = usbwire("list", "--registry", registry, "--json", env=env)
    if out.returncode != 0:
        raise RuntimeError(f"list --registry failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


def reserved(registry, env):
    out = usbwire("who", "--registry", registry, "--json", env=env)
    if out.returncode != 0:
        raise RuntimeError(f"who failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)["reservations"]


def wait_until(predicate, timeout, step=0.2):
    start = time.time()
    while time.time() - start < timeout:
        if predicate():
            return time.time() - start
        time.sleep(step)
    return None


def listen_to_release(port):
    """The guest detaches once it can connect here."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))

    def answer():
        try:
            while True:
                sock.accept()[0].close()
        except OSError:
            pass  # closed by the test

    def go():
        sock.listen(4)
        threading.Thread(target=answer, daemon=True).start()
    return go, sock


def main():
    guest.require(BIN, ETCD, shutil.which("openssl") or "/usr/bin/openssl")
    checks = guest.Checks()
    os.makedirs(guest.LOGS, exist_ok=True)
    work = guest.scratch("usbwire-lab-")
    env = dict(os.environ, XDG_STATE_HOME=os.path.join(work, "state"))
    cluster = Cluster(work)
    disk_image = os.path.join(work, "guest.img")
    with open(disk_image, "wb") as f:
        f.write(MARKER + bytes(512 - len(MARKER)))
        f.truncate(4 << 20)
    prefix = f"lab-test-{os.getpid()}"
    registry = f"etcd://{cluster.endpoints()}/{prefix}"
    table = "endpoints = [" + ", ".join(f'"127.0.0.1:{p}"' for p in cluster.client_ports) + f']\nprefix = "{prefix}"'
    servers = Servers(work, table, disk_image)
    watcher = None
    intruder = None
    g = None
    try:
        cluster.start_all()
        print(f"etcd cluster up: {cluster.endpoints()}", flush=True)
        for n in range(6):
            servers.start(n)
        for n in range(6):
            checks.check(f"server {n} registered", servers.wait_log(n, "registered in the lab registry", 20), servers.log(n)[-400:])
        first_leases = leases(cluster.client_ports[1], f"{prefix}/servers/")
        checks.check("6 servers, each under a lease of its own",
                     len(first_leases) == 6 and len(set(first_leases.values())) == 6 and 0 not in first_leases.values(),
                     first_leases)
        watch_log = open(os.path.join(guest.LOGS, "lab.watch.log"), "w")
        watcher = subprocess.Popen([BIN, "list", "--registry", registry, "--watch", "--json"], stdout=watch_log,
                                   stderr=subprocess.STDOUT, env=env)

        view = fleet(registry, env)
        nucleo = [d for d in view["devices"] if "nucleo" in d["labels"]]
        checks.check("list --registry: 6 servers", len(view["servers"]) == 6, [s["address"] for s in view["servers"]])
        checks.check("list --registry: 16 devices, 10 labelled nucleo", len(view["devices"]) == 16 and len(nucleo) == 10,
                     f"{len(view['devices'])} devices, {len(nucleo)} nucleo")
        checks.check("every device available with its server's state", all(d["state"] == "available" for d in view["devices"]),
                     [(d["server"], d["busid"], d["state"]) for d in view["devices"]])
        text = usbwire("list", "--registry", registry, env=env).stdout
        checks.check("list --registry text names servers, devices and labels",
                     "6 server(s), 16 device(s), 16 free" in text and "nucleo" in text and "usbwire disk" in text, text)
        streamed = usbwire("list", "--registry", registry, "--json-lines", env=env)
        try:
            objects = [json.loads(line) for line in streamed.stdout.splitlines()]
        except ValueError:
            objects = []
        kinds = [o.get("what") for o in objects]
        checks.check("list --registry --json-lines: the revision, 6 servers, 16 devices, then the counts",
                     streamed.returncode == 0 and kinds[:2] == ["fleet", "server"] and kinds[-1:] == ["listed"]
                     and kinds.count("server") == 6 and kinds.count("device") == 16
                     and objects[-1].get("devices") == 16 and objects[0].get("revision") == objects[-1].get("revision"),
                     f"{kinds} {streamed.stderr.strip()}")
        filtered = usbwire("list", "--registry", registry, "--device", "label=nucleo", "--json", env=env)
        places = sorted((d["server"], d["busid"]) for d in json.loads(filtered.stdout or "{}").get("devices", []))
        checks.check("list --registry --device label=nucleo lists exactly the 10 nucleo devices",
                     filtered.returncode == 0 and places == sorted((d["server"], d["busid"]) for d in nucleo),
                     f"{places} {filtered.stderr.strip()}")

        # ---- Planted entries: a plain server, and an intruder's TLS server under another's key ----
        disk_server = next(e for e in view["servers"] if e["address"] == f"10.0.2.2:{servers.ports[5]}")
        checks.check("the guest disk's server registers its TLS key", bool(disk_server.get("tls_fingerprint")), disk_server)
        intruder_port = guest.free_port()
        intruder_log = os.path.join(guest.LOGS, "lab.intruder.log")
        intruder = subprocess.Popen([BIN, "serve", "--listen", f"127.0.0.1:{intruder_port}", "--no-advertise", "--tls",
                                     "--identity", os.path.join(work, "intruder"), "--allow", "*", "--allow-any-client",
                                     "--virtual", "keyboard", "--control", os.path.join(work, "intruder.sock")],
                                    stdout=open(intruder_log, "w"), stderr=subprocess.STDOUT)
        planted = plant(cluster.client_ports[0], prefix, f"10.0.2.2:{guest.free_port()}", None, "1-1", "planted-plain")
        planted += plant(cluster.client_ports[0], prefix, f"10.0.2.2:{intruder_port}", disk_server["tls_fingerprint"],
                         "1-1", "planted-tls")

        # ---- The guest takes a disk by label, knowing only the registry ----
        go_port = guest.free_port()
        go, go_sock = listen_to_release(go_port)
        go2_port = guest.free_port()
        go2, go2_sock = listen_to_release(go2_port)
        guest_endpoints = ", ".join(f'"10.0.2.2:{p}"' for p in cluster.client_ports)
        script = (GUEST_SCRIPT.replace("__REGISTRY__", f"etcd://{cluster.endpoints('10.0.2.2')}/{prefix}")
                  .replace("__GO__", str(go_port)).replace("__GO2__", str(go2_port))
                  .replace("__ENDPOINTS__", guest_endpoints).replace("__PREFIX__", prefix))
        g = guest.Guest("lab", script, files={BIN: "/usr/bin/usbwire"}, timeout=400)
        print(f"guest: {g.wait_for('@@PLANTED-OUT', 300)}", flush=True)
        g.wait_for("@@PLANTED-DONE", 60)
        left = [d for d in reserved(registry, env) if d["labels"][:1] in (["planted-plain"], ["planted-tls"])]
        checks.check("the refused attaches gave their reservations back", not left, left)
        unplant(cluster.client_ports[0], planted)
        intruder.terminate()
        intruder.wait(10)
        held_line = g.wait_for("@@HELD", 300)
        print(f"guest: {held_line}", flush=True)
        who = reserved(registry, env)
        mine = [d for d in who if "guestdisk" in d["labels"]]
        checks.check("while attached, who shows the guest's reservation by `usbwire attach`",
                     len(mine) == 1 and mine[0]["reservation"]["client"] == "usbwire attach", who)
        in_use = [d for d in fleet(registry, env)["devices"] if "guestdisk" in d["labels"]]
        checks.check("the attached disk is in use in the registry", in_use and in_use[0]["state"] == "in_use", in_use)
        go()
        g.wait_for("@@DETACHED", 120)
        took = wait_until(lambda: not [d for d in reserved(registry, env) if "guestdisk" in d["labels"]], 5)
        checks.check("detach gave the reservation back", took is not None)
        g.wait_for("@@SERVICE-HELD", 180)
        who = reserved(registry, env)
        mine = [d for d in who if "guestdisk" in d["labels"]]
        checks.check("the client service holds its device reserved (`usbwire client`)",
                     len(mine) == 1 and mine[0]["reservation"]["client"] == "usbwire client", who)
        go2()
        g.wait_for("@@SERVICE-DONE", 120)
        g.wait_for("@@RESERVE-DONE", 240)
        rc = g.finish(60)
        console = open(g.console_path, errors="replace").read()
        for line in console.splitlines():
            if line.startswith("@@CHECK "):
                _, name, verdict, *detail = line.split(" ", 3)
                checks.check(f"guest: {name}", verdict == "PASS", " ".join(detail))
        checks.check("guest script finished", rc == 0, rc)
        go_sock.close()
        go2_sock.close()
        took = wait_until(lambda: not [d for d in reserved(registry, env) if "guestdisk" in d["labels"]], 5)
        checks.check("stopping the service gave the reservation back", took is not None)

        # ---- 20 clients race for the 10 nucleo devices ----
        racers = [subprocess.Popen([BIN, "reserve", "--registry", registry, "--device", "label=nucleo", "--for", "5m", "--json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(20)]
        results = [(p.wait(60), p.stdout.read(), p.stderr.read()) for p in racers]
        won = [json.loads(out) for rc, out, _ in results if rc == 0]
        lost = [(rc, err) for rc, _, err in results if rc != 0]
        held = {(r["server"], r["busid"]) for r in won}
        checks.check("20 racing clients: 10 reserved a device", len(won) == 10, f"{len(won)} won; losers: {lost[:3]}")
        checks.check("each device held by exactly one client", len(held) == len(won) == 10, sorted(held))
        checks.check("the other 10 were told none is free (exit 75)",
                     len(lost) == 10 and all(rc == 75 and "no free device matches label=nucleo" in err for rc, err in lost), lost[:3])
        who = reserved(registry, env)
        checks.check("who lists the 10 reservations", len(who) == 10, len(who))
        server, busid = sorted(held)[0]
        refused = usbwire("describe", "-r", server, "-b", busid, env=env)
        checks.check("a reserved device refuses a direct import", refused.returncode != 0 and "busy" in refused.stderr,
                     (refused.returncode, refused.stderr.strip()))
        keyboard = next(d for d in fleet(registry, env)["devices"] if "kbd" in d["labels"])
        direct = usbwire("describe", "-r", keyboard["server"], "-b", keyboard["busid"], env=env)
        checks.check("an unreserved device imports directly", direct.returncode == 0, direct.stderr.strip()[-300:])

        released = usbwire("release", "--registry", registry, "--device", "label=nucleo", env=env)
        checks.check("release gives back all 10", released.returncode == 0 and released.stdout.count("released ") == 10,
                     released.stdout + released.stderr)
        again = [subprocess.Popen([BIN, "reserve", "--registry", registry, "--device", "label=nucleo", "--for", "5m", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(10)]
        again_rcs = [p.wait(60) for p in again]
        checks.check("released devices are reusable at once: 10 of 10 reserved again", again_rcs.count(0) == 10, again_rcs)
        released = usbwire("release", "--registry", registry, "--device", "label=nucleo", env=env)
        checks.check("and released again", released.stdout.count("released ") == 10, released.stdout + released.stderr)

        # ---- a quiet fleet stays quiet, a holding client holds ----
        holder = subprocess.Popen([BIN, "reserve", "--registry", registry, "--device", "label=bench-0,class=08"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = holder.stdout.readline()
        checks.check("a client holds a device while it runs", line.startswith("reserved "), line)
        checks.check("who shows it", len(reserved(registry, env)) == 1)
        quiet_phase(checks, cluster, servers, registry, prefix, env, first_leases)
        holder.kill()
        holder.wait()
        took = wait_until(lambda: not reserved(registry, env), CLIENT_TTL + SLACK)
        checks.check(f"kill -9 the client: its device is free within the ttl ({CLIENT_TTL} s)", took is not None,
                     "still reserved")
        print(f"  client's reservation gone {took} s after kill -9", flush=True)

        # ---- kill -9 a server ----
        victim = servers.ports[4]
        servers.procs[4].kill()
        servers.procs[4].wait()
        took = wait_until(lambda: all(s["address"] != f"127.0.0.1:{victim}" for s in fleet(registry, env)["servers"]),
                          SERVER_TTL + SLACK)
        checks.check(f"kill -9 a server: gone from the registry within its ttl ({SERVER_TTL} s)", took is not None)
        print(f"  server gone {took} s after kill -9", flush=True)
        view = fleet(registry, env)
        checks.check("its devices went with it", all(d["server"] != f"127.0.0.1:{victim}" for d in view["devices"]),
                     len(view["devices"]))

        # ---- one etcd member stops ----
        cluster.stop(0)
        one = usbwire("reserve", "--registry", registry, "--device", "label=nucleo", "--for", "1m", "--json", env=env)
        checks.check("one member down: a reservation still works", one.returncode == 0, one.stderr.strip())
        # Clients try the members in random order: several calls meet the stopped one first.
        views = [fleet(registry, env) for _ in range(6)]
        view = views[-1]
        checks.check("one member down: the fleet view still works (5 servers, 6 times of 6)",
                     all(len(v["servers"]) == 5 for v in views), [len(v["servers"]) for v in views])
        released = usbwire("release", "--registry", registry, "--device", "label=nucleo", env=env)
        checks.check("one member down: release still works", released.returncode == 0, released.stderr.strip())
        cluster.start(0)
        cluster.wait_healthy([0])

        # ---- the whole cluster stops ----
        cluster.stop_all()
        for n in (0, 1):
            checks.check(f"cluster down: server {n} says the registry is unreachable",
                         servers.wait_log(n, "lab registry unreachable", SERVER_TTL + 15), servers.log(n)[-300:])
        down = usbwire("list", "--registry", registry, env=env, timeout=30)
        checks.check("cluster down: a client says the registry is unreachable (exit 69)",
                     down.returncode == 69 and "unreachable" in down.stderr, (down.returncode, down.stderr.strip()))
        disk = next(d for d in view["devices"] if d["server"] == f"127.0.0.1:{servers.ports[1]}" and d["kind"] == "disk")
        direct = usbwire("describe", "-r", disk["server"], "-b", disk["busid"], env=env)
        checks.check("cluster down: servers keep serving devices directly", direct.returncode == 0, direct.stderr.strip()[-300:])
        cluster.start_all()
        for n in (0, 1, 2, 3, 5):
            checks.check(f"cluster back: server {n} registered again",
                         servers.wait_log(n, "registered again in the lab registry", 30), servers.log(n)[-300:])
        view = fleet(registry, env)
        checks.check("cluster back: 5 servers and their 13 devices listed", len(view["servers"]) == 5 and len(view["devices"]) == 13,
                     (len(view["servers"]), len(view["devices"])))

        tls_phase(checks, work, env)

        # ---- SIGTERM a server: it leaves the registry at once ----
        leaving = f"127.0.0.1:{servers.ports[2]}"
        servers.procs[2].send_signal(signal.SIGTERM)

        def gone():
            view = fleet(registry, env)
            return all(d["server"] != leaving for d in view["devices"]) and all(s["address"] != leaving for s in view["servers"])
        took = wait_until(gone, 5, step=0.05)
        print(f"  server gone {took} s after SIGTERM", flush=True)
        checks.check("SIGTERM a server: it and its devices are gone from list --registry within 1 s",
                     took is not None and took <= 1.0, (took, servers.log(2)[-300:]))
        rc = servers.procs[2].wait(10)
        checks.check("and it exited cleanly, saying it left the lab registry",
                     rc == 0 and "left the lab registry" in servers.log(2), (rc, servers.log(2)[-300:]))

        watcher.terminate()
        watcher.wait(10)
        watched = [json.loads(line) for line in open(watch_log.name) if line.startswith("{")]
        changes = watched[1:]
        kinds = {(c["what"], c["entry"] is None) for c in changes}
        checks.check("--watch: the fleet first, then changes live (reservations made and ended, devices, a server gone)",
                     watched and "servers" in watched[0] and {("reservation", False), ("reservation", True),
                                                               ("device", False), ("server", True)} <= kinds,
                     sorted(kinds))
    except Exception as error:  # noqa: BLE001 - report and fail
        checks.check("test ran to the end", False, f"{type(error).__name__}: {error}")
    finally:
        if g:
            g.kill()
        if watcher and watcher.poll() is None:
            watcher.kill()
        if intruder and intruder.poll() is None:
            intruder.kill()
        servers.stop_all()
        cluster.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    print(f"logs: {guest.LOGS}/lab.*", flush=True)
    checks.exit()


if __name__ == "__main__":
    main()
