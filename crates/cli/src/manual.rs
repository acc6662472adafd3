//! The manual beyond the flags, written once: examples for each verb,
//! environment, files, and the configuration files' keys (usbwire.toml(5));
//! the exit statuses are `crate::exit::EXIT_CODES`, shown from there. `--help` shows it after the options
//! ([`after_help`]); `usbwire man` renders the same text as roff sections
//! (`commands::docs`). The flags' own help stays with the flags (`args`).

/// One example: the command, and what it does.
pub(crate) struct Example {
    pub(crate) command: &'static str,
    pub(crate) what: &'static str,
}

// size-exempt: a table, one arm of examples per verb.
/// The examples of `verb` (`None`: the program's own page).
pub(crate) fn examples(verb: Option<&str>) -> &'static [Example] {
    match verb {
        None => &[
            Example {
                command: "usbwire demo",
                what: "a keyboard, a disk and a serial port on 127.0.0.1, and what to try next",
            },
            Example {
                command: "usbwire serve --virtual keyboard --virtual disk=disk.img,size=64M",
                what: "export two virtual devices",
            },
            Example {
                command: "usbwire list -r 192.168.1.5",
                what: "what a server exports (as `usbip list -r` prints it)",
            },
            Example {
                command: "sudo usbwire attach -r 192.168.1.5 -b 0-2",
                what: "use one of them here, through vhci-hcd: the disk (virtual devices are 0-1, 0-2 … in the order given)",
            },
            Example {
                command: "usbwire bind --device 0781:5567",
                what: "export a real device wherever it is plugged in, across restarts",
            },
        ],
        Some("serve") => &[
            Example {
                command:
                    "usbwire serve --virtual keyboard --virtual disk=/var/lib/usbwire/disk.img,size=1G,speed=super",
                what: "a keyboard and a SuperSpeed disk on 0.0.0.0:3240",
            },
            Example {
                command: "usbwire serve --bind 0781:5567 --bind serial=4C530001",
                what: "real devices, now and when plugged in",
            },
            Example {
                command: "usbwire serve --config /etc/usbwire/server.toml",
                what: "everything from a file (usbwire.toml(5))",
            },
            Example {
                command: "usbwire serve --tls --allow sha256:… --http 127.0.0.1:8324",
                what: "TLS with one admitted client, and a status page on loopback",
            },
        ],
        Some("list") => &[
            Example {
                command: "usbwire list -r 192.168.1.5",
                what: "a server's devices in `usbip list -r`'s table, each under its own name",
            },
            Example {
                command: "usbwire list -v -r 192.168.1.5",
                what: "with speeds, and who holds the devices in use",
            },
            Example { command: "usbwire list -l", what: "this machine's devices, with each interface's driver" },
            Example {
                command: "usbwire list -p -l",
                what: "one line per device, byte for byte as `usbip list -p -l`: busid=1-1#usbid=046d:c52b#",
            },
            Example {
                command: "usbwire list --discover",
                what: "servers on the local network (mDNS) and their devices",
            },
            Example {
                command: "usbwire list --registry --json",
                what: "the lab registry's fleet, as JSON (docs/json.md)",
            },
            Example {
                command: "usbwire list --registry --json-lines --watch",
                what: "the fleet one JSON object per line as it is read, then every change from that revision",
            },
        ],
        Some("describe") => &[Example {
            command: "usbwire describe -r 192.168.1.5 -b 0-2",
            what: "the descriptor tree, like `lsusb -v`, of a server's device: here a virtual disk (`usbwire demo`'s 0-2)",
        }],
        Some("bench") => &[
            Example { command: "usbwire bench --quick", what: "a short run against a local loopback device" },
            Example {
                command: "usbwire bench -r 192.168.1.5 -b 0-1 --rtt-ms 0,20",
                what: "a server's loopback device (`usbwire serve --virtual loopback` exports it as 0-1), with 20 ms of added delay",
            },
            Example {
                command: "usbwire bench --storage --rtt-ms 0,10,50",
                what: "a 64 MiB virtual disk's 120 KiB reads and writes through the attach relay, its storage accelerator off and on",
            },
        ],
        Some("attach") => &[
            Example {
                command: "sudo modprobe vhci-hcd && sudo usbwire attach -r 192.168.1.5 -b 0-2",
                what: "into this kernel: a server's virtual disk (`usbwire demo`'s 0-2; `usbwire list -r` shows the bus ids)",
            },
            Example { command: "sudo usbwire attach -r server -b 0-1 --tls", what: "over TLS, through a local relay" },
            Example {
                command: "sudo usbwire attach --auto-attach -r 192.168.1.5 -b 0-2",
                what: "keep it attached (usbipd-win's --auto-attach): again after every loss, until Ctrl-C",
            },
            Example {
                command: "sudo usbwire attach --registry --device label=nucleo --for 2h",
                what: "a free one from the default lab registry, wherever it is",
            },
        ],
        Some("port") => &[
            Example { command: "usbwire port", what: "what is attached where" },
            Example { command: "usbwire port --json", what: "the same, as JSON" },
        ],
        Some("detach") => {
            &[Example { command: "sudo usbwire detach -p 0", what: "detach port 0 (see `usbwire port`)" }]
        }
        Some("identity") => &[
            Example {
                command: "usbwire identity --create",
                what: "this machine's key pair, and its sha256: fingerprint",
            },
            Example { command: "usbwire identity --dir ca --ca-create fleet", what: "a private CA for many clients" },
        ],
        Some("type") => {
            &[Example { command: "usbwire type 'hello from usbwire'", what: "key presses on the attached machine" }]
        }
        Some("state") => &[
            Example { command: "usbwire state", what: "the exported devices and who holds them" },
            Example { command: "usbwire state --json", what: "with each device's traffic counters" },
        ],
        Some("client") => &[Example {
            command: "sudo usbwire client --config /etc/usbwire/client.toml",
            what: "keep [[attach]] rules attached",
        }],
        Some("doctor") => &[
            Example {
                command: "usbwire doctor",
                what: "this machine: vhci-hcd, usbfs, clock, identity, the local server",
            },
            Example {
                command: "usbwire doctor -r 192.168.1.5",
                what: "and a server: port, plain or TLS, whether it admits us",
            },
        ],
        Some("bind") => &[
            Example {
                command: "usbwire bind -b 1-1.2",
                what: "the real device at that port of this machine (`usbwire list -l` shows them), like `usbip bind`",
            },
            Example {
                command: "usbwire bind --device 0781:5567",
                what: "every such device, now and whenever plugged in, across restarts",
            },
            Example {
                command: "usbwire bind --device serial=4C530001",
                what: "one device by its serial number, wherever it is plugged in",
            },
        ],
        Some("unbind") => &[
            Example {
                command: "usbwire unbind -b 1-1.2",
                what: "stop exporting the real device at that port; its kernel drivers take it back",
            },
            Example { command: "usbwire unbind --device 0781:5567", what: "forget a --device bind" },
            Example { command: "usbwire unbind --all", what: "forget every bind and withdraw every real device" },
        ],
        Some("demo") => &[Example {
            command: "usbwire demo",
            what: "then `sudo usbip attach -r 127.0.0.1 -b 0-1` (the keyboard; the disk is 0-2, the serial port 0-3) and `usbwire type hello`",
        }],
        Some("redir") => &[Example {
            command: "usbwire redir -r 192.168.1.5 -b 0-2 --listen unix:/run/usbwire/redir.sock",
            what: "a server's virtual disk (`usbwire demo`'s 0-2) for QEMU: -chardev socket,id=r,path=/run/usbwire/redir.sock -device usb-redir,chardev=r",
        }],
        Some("capture") => &[
            Example {
                command: "usbwire capture /var/lib/usbwire/capture",
                what: "every import from now on, into pcapng files",
            },
            Example { command: "usbwire capture --stop", what: "stop" },
        ],
        Some("reserve") => &[
            Example {
                command: "usbwire reserve --device 0483:374b,label=bench-3 --for 1h",
                what: "take a free one for an hour",
            },
            Example {
                command: "usbwire reserve --registry etcd://10.0.0.5:2379 --device label=nucleo",
                what: "hold one until Ctrl-C",
            },
        ],
        Some("release") => {
            &[Example { command: "usbwire release --device label=nucleo", what: "give yours back (--force: anyone's)" }]
        }
        Some("who") => &[Example {
            command: "usbwire who",
            what: "who holds which device of the default lab registry, since and until when",
        }],
        Some("udev-rules") => &[Example {
            command:
                "usbwire udev-rules --config /etc/usbwire/server.toml | sudo tee /etc/udev/rules.d/70-usbwire.rules",
            what: "usbfs access for the server's group, to its [[bind]] devices only",
        }],
        Some("completions") => {
            &[Example { command: "usbwire completions bash > /etc/bash_completion.d/usbwire", what: "bash completion" }]
        }
        Some("man") => &[Example { command: "usbwire man --dir /usr/local/share/man/man1", what: "these pages" }],
        Some("version") => &[Example { command: "usbwire version --json", what: "the versions, for a script" }],
        Some(_) => &[],
    }
}

/// Environment variables usbwire reads.
pub(crate) const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "USBWIRE_REGISTRY",
        "the lab registry (etcd://HOST:PORT[,…][/PREFIX]) reserve, release, who and a bare --registry use",
    ),
    ("USBWIRE_CONFIG", "the user's usbwire.toml, instead of the one in the user's usbwire directory"),
    ("RUST_LOG", "log filter (tracing's EnvFilter syntax), over -v and -q"),
    (
        "XDG_CONFIG_HOME",
        "the user's usbwire directory is $XDG_CONFIG_HOME/usbwire (else ~/.config/usbwire; root's /etc/usbwire)",
    ),
    ("XDG_STATE_HOME", "binds and reservation tokens go under $XDG_STATE_HOME/usbwire (else ~/.local/state/usbwire)"),
    (
        "XDG_RUNTIME_DIR",
        "the control socket is $XDG_RUNTIME_DIR/usbwire/control.sock (else /tmp/usbwire-UID; root's /run/usbwire)",
    ),
    ("NOTIFY_SOCKET, JOURNAL_STREAM", "set by systemd: the server says when it is ready, and logs for the journal"),
];

/// Files usbwire reads and writes.
pub(crate) const FILES: &[(&str, &str)] = &[
    ("/etc/usbwire/server.toml", "the server's configuration (serve --config; usbwire.toml(5))"),
    ("/etc/usbwire/client.toml", "the client service's [[attach]] rules (client --config; usbwire.toml(5))"),
    (
        "~/.config/usbwire/usbwire.toml",
        "the user's defaults: [registry] (root's /etc/usbwire/usbwire.toml; usbwire.toml(5))",
    ),
    (
        "~/.config/usbwire/identity.crt, identity.key",
        "this machine's TLS identity (root's in /etc/usbwire), the key 0600",
    ),
    ("~/.config/usbwire/known_servers", "servers' pinned TLS keys, like ssh's known_hosts"),
    ("/run/usbwire/control.sock", "the running server's control socket (type, state, bind, capture), 0600"),
    (
        "/var/lib/usbwire/binds",
        "what `usbwire bind` bound, kept across restarts (--bind-state; others' in ~/.local/state/usbwire/binds)",
    ),
    (
        "/var/lib/usbwire-client/reservations/",
        "tokens of reserve --for (others' in ~/.local/state/usbwire/reservations/)",
    ),
    ("/var/run/vhci_hcd/", "records of what is attached to each vhci port (shared with usbip)"),
];

/// One table of a configuration file: its keys, each with a value's form and meaning.
pub(crate) struct ConfigTable {
    /// The file it belongs to (`server`, `client`, `user`).
    pub(crate) file: &'static str,
    /// `""` for the top level, else `[name]` or `[[name]]`.
    pub(crate) table: &'static str,
    pub(crate) keys: &'static [(&'static str, &'static str, &'static str)],
    /// Keys written from the parser's own lists, before `keys` (`[[virtual]]`'s kinds and theirs).
    pub(crate) generated: Option<fn() -> Vec<ConfigRow>>,
}

/// A key of a configuration table: `key`, the form of its value, what it means.
pub(crate) type ConfigRow = (String, String, String);

impl ConfigTable {
    /// Every key of the table: `key`, the form of its value, what it means.
    pub(crate) fn rows(&self) -> Vec<ConfigRow> {
        let mut rows = self.generated.map(|generate| generate()).unwrap_or_default();
        rows.extend(self.keys.iter().map(|(key, form, meaning)| ((*key).into(), (*form).into(), (*meaning).into())));
        rows
    }
}

/// `[[virtual]]`'s `kind` and each kind's keys, from the parser's
/// [`VIRTUAL_KINDS`](crate::config::VIRTUAL_KINDS) and
/// [`VIRTUAL_KEYS`](crate::config::VIRTUAL_KEYS): a kind or key the parser
/// takes is documented without anyone remembering to.
fn virtual_rows() -> Vec<ConfigRow> {
    let kinds: Vec<String> = crate::config::VIRTUAL_KINDS.iter().map(|(kind, _)| format!("\"{kind}\"")).collect();
    let mut rows = vec![("kind".to_owned(), kinds.join("|"), "the virtual device".to_owned())];
    for crate::config::VirtualKey { key, form, meanings } in crate::config::VIRTUAL_KEYS {
        // Kinds that mean the same by it share one entry: "disk, loopback: the speed it reports".
        let mut said: Vec<(Vec<&str>, &str)> = Vec::new();
        for (kind, meaning) in *meanings {
            match said.iter_mut().find(|(_, m)| m == meaning) {
                Some((kinds, _)) => kinds.push(kind),
                None => said.push((vec![kind], meaning)),
            }
        }
        let meaning: Vec<String> = said.iter().map(|(kinds, m)| format!("{}: {m}", kinds.join(", "))).collect();
        rows.push(((*key).to_owned(), (*form).to_owned(), meaning.join("; ")));
    }
    rows
}

/// Every key of the three configuration files (usbwire.toml(5)).
pub(crate) const CONFIG: &[ConfigTable] = &[
    ConfigTable {
        file: "server",
        table: "",
        keys: &[
            ("listen", "\"ADDR:PORT\"", "where USB/IP is served (default 0.0.0.0:3240)"),
            ("control", "\"PATH\"", "the control socket (as --control)"),
            ("advertise", "true|false", "announce the server with mDNS/DNS-SD (default true)"),
            ("tls", "true|false", "require TLS 1.3 with client certificates"),
            ("identity", "\"DIR\"", "the server's identity directory"),
            ("allow_plain", "\"never\"|\"loopback\"|\"always\"", "plain USB/IP beside TLS (default loopback)"),
            ("ca", "\"FILE\"", "a private CA whose clients client = \"ca:NAME\" rules admit"),
            ("allow_any_client", "true|false", "let client = \"*\" admit any client key"),
            (
                "resume_grace",
                "SECONDS",
                "how long a dropped import waits for its client to resume (default 30; 0: off)",
            ),
            ("metrics", "\"ADDR:PORT\"", "Prometheus text at http://ADDR:PORT/metrics"),
            ("http", "\"ADDR:PORT\"", "the status page at http://ADDR:PORT/"),
            ("http_hosts", "[\"NAME\", …]", "host names the HTTP listeners answer besides IP literals and localhost"),
            ("capture", "\"DIR\"", "a pcapng file (usbmon) per import, in a private directory"),
            ("capture_max_bytes", "BYTES", "all capture files together (default 1 GiB; the oldest deleted first)"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[[virtual]]",
        keys: &[("labels", "[\"NAME\", …]", "how the lab registry shows it (label=NAME selects it)")],
        generated: Some(virtual_rows),
    },
    ConfigTable {
        file: "server",
        table: "[[bind]]",
        keys: &[
            ("device", "\"SELECTOR\"", "a real device: bus id (1-1.2), VID:PID, serial=TEXT or class=HEX"),
            ("also", "[\"SELECTOR\", …]", "the same device under other identities (its bootloader)"),
            ("labels", "[\"NAME\", …]", "how the lab registry shows it"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[[allow]]",
        keys: &[
            ("client", "\"sha256:…\"|\"ca:NAME\"|\"plain\"|\"*\"", "whom the rule admits"),
            ("devices", "[\"BUSID\"|\"KIND\"|\"*\", …]", "what that client sees and imports"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[[redir]]",
        keys: &[
            ("device", "\"SELECTOR\"", "the device offered to QEMU guests through usbredir"),
            ("listen", "\"unix:PATH\"|\"ADDR:PORT\"", "where guests connect (TCP only with allow_unauthenticated)"),
            ("group", "\"GROUP\"", "the socket 0660 for QEMU's group"),
            ("allow_unauthenticated", "true|false", "let listen be a TCP port (usbredir has no authentication)"),
            ("follow", "true|false", "keep the guest's device through re-enumerations (default: true for a bus id)"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[registry]",
        keys: &[
            ("endpoints", "[\"HOST:PORT\", …]", "the etcd cluster of the lab registry"),
            ("prefix", "\"NAME\"", "the registry's key prefix (default usbwire)"),
            ("address", "\"HOST:PORT\"", "what clients import from (default listen, or the host name)"),
            ("ttl", "\"10s\"", "a server that dies leaves the registry after this"),
            ("ca", "\"FILE\"", "TLS towards etcd: the CA of its members"),
            ("cert", "\"FILE\"", "TLS towards etcd: a client certificate"),
            ("key", "\"FILE\"", "TLS towards etcd: its key"),
            ("plain", "true|false", "client: also servers whose entry has no TLS key, over plain USB/IP"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[limits]",
        keys: &[
            ("max_transfer_length", "\"16M\"", "the largest URB a client may submit"),
            ("in_flight_bytes", "\"64M\"", "URB bytes handed to devices and not completed"),
            ("in_flight_urbs", "1024", "URBs handed to devices and not completed"),
            ("queued_reply_bytes", "\"8M\"", "replies waiting for the client to read them"),
            ("unacked_reply_bytes", "\"32M\"", "replies a resumable session keeps until acknowledged"),
            ("decoded_bytes", "\"8M\"", "decompressed bytes waiting (--compress)"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "server",
        table: "[admission]",
        keys: &[
            ("unauthenticated_max", "64", "connections not yet authenticated, from all addresses"),
            ("per_address_max", "8", "the same, from one IPv4 address or IPv6 /64"),
            ("first_byte_timeout", "\"3s\"", "accept to first byte"),
            ("handshake_timeout", "\"3s\"", "the TLS handshake"),
            ("request_timeout", "\"3s\"", "each OP request"),
            ("release_wait", "\"5s\"", "how long an import waits for a device its last importer is giving back"),
            ("log_interval", "\"10s\"", "at most one summary line of refused connections per interval"),
        ],
        generated: None,
    },
    ConfigTable {
        file: "client",
        table: "",
        keys: &[
            ("identity", "\"DIR\"", "the identity for TLS rules"),
            (
                "registry",
                "table",
                "[registry] as above (endpoints, prefix, ca, cert, key, plain) for server = \"registry\" rules",
            ),
        ],
        generated: None,
    },
    ConfigTable {
        file: "client",
        table: "[[attach]]",
        keys: &[
            ("server", "\"HOST:PORT\"|\"discover\"|\"registry\"", "where the device is"),
            ("device", "\"SELECTOR\"", "which device"),
            ("also", "[\"SELECTOR\", …]", "the same device in another mode"),
            ("tls", "true|false", "over TLS (needed for discover)"),
            (
                "follow",
                "true|false",
                "attach again when the device re-enumerates at its port (default: true for a bus id)",
            ),
            ("labels", "[\"NAME\", …]", "server = \"registry\": the device must carry these labels"),
            (
                "accelerate",
                "\"auto\"|\"off\"",
                "descriptor snapshot and pipelined mass storage from usbwire servers (default: auto; attach --accelerate)",
            ),
        ],
        generated: None,
    },
    ConfigTable {
        file: "user",
        table: "",
        keys: &[(
            "registry",
            "table",
            "[registry] as above (endpoints, prefix, ca, cert, key): the default lab registry of every registry verb",
        )],
        generated: None,
    },
];

/// What each configuration file is, for usbwire.toml(5).
pub(crate) const CONFIG_FILES: &[(&str, &str)] = &[
    ("server", "usbwire serve --config FILE (/etc/usbwire/server.toml for the packaged service); flags win over it"),
    ("client", "usbwire client --config FILE (/etc/usbwire/client.toml)"),
    (
        "user",
        "usbwire.toml in the user's usbwire directory (~/.config/usbwire/, root's /etc/usbwire/, or $USBWIRE_CONFIG)",
    ),
];

/// The text `--help` shows after the options: the examples, and on the
/// program's own help also exit statuses, environment and files.
pub(crate) fn after_help(verb: Option<&str>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let examples = examples(verb);
    if !examples.is_empty() {
        out.push_str("Examples:\n");
        for example in examples {
            let _ = writeln!(out, "  {}\n      {}", example.command, example.what);
        }
    }
    if verb.is_none() {
        out.push_str("\nExit status:\n    0  success\n");
        for (code, name, when) in crate::exit::EXIT_CODES {
            let _ = writeln!(out, "  {code:>3}  {name}: {when}");
        }
        out.push_str("\nEnvironment:\n");
        for (name, meaning) in ENVIRONMENT {
            let _ = writeln!(out, "  {name}\n      {meaning}");
        }
        out.push_str("\nFiles:\n");
        for (path, meaning) in FILES {
            let _ = writeln!(out, "  {path}\n      {meaning}");
        }
        out.push_str("\nThe configuration files' keys: usbwire.toml(5) (`usbwire man --dir DIR` writes it).\n");
    } else {
        out.push_str("\nExit status, environment and files: usbwire --help, usbwire(1).\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys a `deny_unknown_fields` table lists when it refuses one.
    fn accepted_keys<T: serde::de::DeserializeOwned + std::fmt::Debug>(toml_text: &str) -> Vec<String> {
        let error = toml::from_str::<T>(toml_text).expect_err("an unknown key is refused").to_string();
        // "unknown field `x`, expected one of `a`, `b`, …" (or "expected `a` or `b`").
        let listed = error.split(", expected").nth(1).unwrap_or_else(|| panic!("no key list in: {error}"));
        let mut keys: Vec<String> = listed.split('`').skip(1).step_by(2).map(str::to_owned).collect();
        keys.sort();
        keys
    }

    fn documented(file: &str, table: &str) -> Vec<String> {
        let table = CONFIG.iter().find(|t| t.file == file && t.table == table).expect("documented table");
        let mut keys: Vec<String> = table.rows().into_iter().map(|(key, _, _)| key).collect();
        keys.sort();
        keys
    }

    /// What the parser accepts is what usbwire.toml(5) documents, table by table.
    #[test]
    fn every_configuration_key_is_documented_and_every_documented_key_exists() {
        use crate::config::FileConfig;
        let mut server_top = accepted_keys::<FileConfig>("no_such_key = 1\n");
        server_top.retain(|key| {
            !["virtual", "bind", "redir", "allow", "registry", "limits", "admission"].contains(&key.as_str())
        });
        assert_eq!(server_top, documented("server", ""));
        assert_eq!(
            accepted_keys::<FileConfig>("[[bind]]\ndevice = \"1-1\"\nx = 1\n"),
            documented("server", "[[bind]]")
        );
        assert_eq!(
            accepted_keys::<FileConfig>("[[allow]]\nclient = \"plain\"\ndevices = []\nx = 1\n"),
            documented("server", "[[allow]]")
        );
        assert_eq!(accepted_keys::<FileConfig>("[limits]\nx = 1\n"), documented("server", "[limits]"));
        assert_eq!(accepted_keys::<FileConfig>("[admission]\nx = 1\n"), documented("server", "[admission]"));
        assert_eq!(
            accepted_keys::<FileConfig>("[registry]\nendpoints = []\nx = 1\n"),
            documented("server", "[registry]")
        );
        assert_eq!(
            accepted_keys::<FileConfig>("[[redir]]\ndevice = \"1-1\"\nlisten = \"unix:/r.sock\"\nx = 1\n"),
            documented("server", "[[redir]]")
        );
        // [[virtual]]: each kind takes its own keys; together they are the documented ones.
        let mut every_virtual_key: Vec<String> =
            crate::config::VIRTUAL_KINDS.iter().flat_map(|(_, keys)| keys.iter().map(|k| (*k).to_owned())).collect();
        every_virtual_key.extend(["kind".to_owned(), "labels".to_owned()]);
        every_virtual_key.sort();
        every_virtual_key.dedup();
        assert_eq!(documented("server", "[[virtual]]"), every_virtual_key);
        let mut client_top = accepted_keys::<crate::config::ClientConfig>("x = 1\n");
        client_top.retain(|key| key != "attach");
        assert_eq!(client_top, documented("client", ""));
        assert_eq!(
            accepted_keys::<crate::config::ClientConfig>("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"\nx = 1\n"),
            documented("client", "[[attach]]")
        );
        assert_eq!(accepted_keys::<crate::config::UserConfig>("x = 1\n"), documented("user", ""));
    }

    /// `VIRTUAL_KINDS`, which the parser checks keys against and the manual
    /// is written from, says what serde's `VirtualSpec` takes: every kind, and
    /// each kind's fields.
    #[test]
    fn the_virtual_kinds_list_is_what_the_parser_takes_and_the_manual_says() {
        use crate::config::{VirtualKey, VirtualSpec, VIRTUAL_KEYS, VIRTUAL_KINDS};
        let kinds: Vec<&str> = VIRTUAL_KINDS.iter().map(|(kind, _)| *kind).collect();
        let mut listed = accepted_keys::<VirtualSpec>("kind = \"no_such_kind\"\n");
        let mut sorted = kinds.clone();
        listed.sort();
        sorted.sort();
        assert_eq!(listed, sorted, "serde's variants");
        for (kind, keys) in VIRTUAL_KINDS {
            let mut keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
            keys.sort();
            let extra = format!("kind = \"{kind}\"\nno_such_key = 1\n");
            if keys.is_empty() {
                // A unit variant: serde takes (and ignores) any key; our check refuses them.
                assert!(toml::from_str::<VirtualSpec>(&extra).is_ok(), "{kind} has fields");
                let refused = toml::from_str::<crate::config::FileConfig>(&format!("[[virtual]]\n{extra}"));
                assert!(refused.is_err(), "{kind}: a key it does not take was accepted");
            } else {
                assert_eq!(accepted_keys::<VirtualSpec>(&extra), keys, "{kind}'s fields");
            }
            // The manual says what each of its keys means for it, and no more.
            for key in &keys {
                let entry = VIRTUAL_KEYS.iter().find(|k| k.key == key).unwrap_or_else(|| panic!("{key} undocumented"));
                assert!(entry.meanings.iter().any(|(k, _)| k == kind), "{key} does not say what it means for {kind}");
            }
        }
        for VirtualKey { key, meanings, .. } in VIRTUAL_KEYS {
            for (kind, _) in *meanings {
                let takes = VIRTUAL_KINDS.iter().any(|(k, keys)| k == kind && keys.contains(key));
                assert!(takes, "the manual says {kind} takes {key}, which it does not");
            }
        }
        let table = CONFIG.iter().find(|t| t.table == "[[virtual]]").expect("[[virtual]] documented");
        let rows = table.rows();
        let kind_row = rows.iter().find(|(key, _, _)| key == "kind").expect("kind documented");
        for kind in &kinds {
            assert!(kind_row.1.contains(&format!("\"{kind}\"")), "{kind} missing from {}", kind_row.1);
        }
        let socket = rows.iter().find(|(key, _, _)| key == "socket").expect("socket documented");
        assert!(socket.2.starts_with("external: "), "{}", socket.2);
    }

    #[test]
    fn help_text_has_the_examples_and_the_program_page_the_rest() {
        let root = after_help(None);
        for section in ["Examples:", "Exit status:", "Environment:", "Files:", "USBWIRE_REGISTRY", " 78  "] {
            assert!(root.contains(section), "{section} missing from:\n{root}");
        }
        assert!(after_help(Some("bind")).contains("usbwire bind --device 0781:5567"));
    }
}
