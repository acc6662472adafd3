//! What several verbs' arguments share: the flag groups they flatten (the control socket, a
//! client's security, the lab registry, a device on a server) and the value parsers of flags
//! that more than one verb takes (`--listen`, `-b BUSID`, durations).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub(crate) struct ControlArgs {
    /// Local control socket [default: /run/usbwire/control.sock for root, else under $XDG_RUNTIME_DIR or /tmp].
    #[arg(long, value_name = "PATH")]
    pub(crate) control: Option<PathBuf>,
}

/// How a client reaches a server: plain USB/IP, or TLS 1.3 with this machine's identity.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ClientSecurityArgs {
    /// Use TLS 1.3 with mutual authentication (the server must run with --tls and allow our identity).
    #[arg(long)]
    pub(crate) tls: bool,
    /// Identity directory [default: /etc/usbwire for root, else ~/.config/usbwire].
    #[arg(long, value_name = "DIR")]
    pub(crate) identity: Option<PathBuf>,
    /// Pin the server's key if it is not known yet (trust on first use).
    #[arg(long)]
    pub(crate) trust_new: bool,
}

/// Where the lab registry (etcd) is.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct RegistryArgs {
    /// The lab registry: etcd://HOST:PORT[,HOST:PORT…][/PREFIX] (an etcd cluster; prefix `usbwire` by
    /// default). Without a value: $USBWIRE_REGISTRY, else [registry] in the user's usbwire.toml.
    #[arg(long, value_name = "etcd://HOST:PORT[,…][/PREFIX]", num_args = 0..=1)]
    pub(crate) registry: Option<Option<usbwire_lab::RegistryUrl>>,
    /// TLS towards etcd: the CA certificate (PEM) its members' certificates are issued by.
    #[arg(long, value_name = "FILE", requires = "registry")]
    pub(crate) registry_ca: Option<PathBuf>,
    /// TLS towards etcd: this machine's client certificate (PEM), when the cluster requires one.
    #[arg(long, value_name = "FILE", requires_all = ["registry", "registry_key"])]
    pub(crate) registry_cert: Option<PathBuf>,
    /// TLS towards etcd: the client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["registry", "registry_cert"])]
    pub(crate) registry_key: Option<PathBuf>,
}

/// A device on a server, and how to reach the server.
#[derive(Args, Debug)]
pub(crate) struct RemoteDevice {
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// The server, HOST[:PORT].
    #[arg(short = 'r', long = "remote", value_name = "HOST[:PORT]")]
    pub(crate) remote: String,
    /// Bus id of the device on the server (`usbwire list -r HOST` shows them; virtual devices are on bus 0: 0-1).
    #[arg(short = 'b', long = "busid", value_parser = bus_id)]
    pub(crate) busid: String,
    /// Port, as `usbip --tcp-port` (when HOST has none).
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
}

/// `--listen`: `ADDR:PORT`, `ADDR` (port 3240), `HOST:PORT` or `HOST` (the
/// name's first address; `localhost` is always 127.0.0.1, as RFC 6761 has it).
pub(super) fn listen_address(text: &str) -> Result<SocketAddr, String> {
    use std::net::{IpAddr, ToSocketAddrs as _};
    let port = usbwire_proto::DEFAULT_PORT;
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Ok(ip) = text.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    // A localhost name is this machine's loopback, resolver or not (RFC 6761).
    match text.rsplit_once(':') {
        Some((host, p)) if usbwire_client::is_localhost(host) => {
            let port = p.parse::<u16>().map_err(|_| format!("{p:?} is not a port"))?;
            return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
        }
        None if usbwire_client::is_localhost(text) => return Ok(SocketAddr::from(([127, 0, 0, 1], port))),
        _ => {}
    }
    let resolved = match text.rsplit_once(':') {
        Some((host, p)) if p.parse::<u16>().is_ok() => text.to_socket_addrs().map_err(|e| (host.to_owned(), e)),
        _ => (text, port).to_socket_addrs().map_err(|e| (text.to_owned(), e)),
    };
    match resolved {
        Ok(mut addrs) => addrs.next().ok_or_else(|| format!("{text:?} has no address")),
        Err((host, error)) => Err(format!("{host:?} is not an address or a host name this machine resolves ({error})")),
    }
}

/// `-b BUSID`: a USB device's bus id as Linux names it, `BUS-PORT[.PORT…]`
/// (a real device's 1-1.2, a virtual one's 0-1). Anything else is refused
/// while the command line is read, so a malformed bus id is a usage error
/// (exit 64) whichever verb it is given to, before any server is asked.
pub(super) fn bus_id(text: &str) -> Result<String, String> {
    let numbers = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    let well_formed = text.len() < usbwire_proto::op::BUSID_LEN
        && text.split_once('-').is_some_and(|(bus, ports)| numbers(bus) && ports.split('.').all(numbers));
    if well_formed {
        return Ok(text.to_owned());
    }
    Err(format!(
        "{text:?} is not a bus id: BUS-PORT[.PORT…], as 0-1 (a virtual device) or 1-1.2 (a real one); \
         `usbwire list -r HOST` shows a server's, `usbwire list -l` this machine's"
    ))
}

/// A duration: `90s`, `30m`, `2h`, `1h30m` (humantime).
pub(super) fn duration(text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration (e.g. 30m, 2h, 1h30m): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_addresses_host_names_and_a_default_port() {
        assert_eq!(listen_address("127.0.0.1:4000"), Ok("127.0.0.1:4000".parse().unwrap()));
        assert_eq!(listen_address("127.0.0.1"), Ok("127.0.0.1:3240".parse().unwrap()));
        assert_eq!(listen_address("::1"), Ok("[::1]:3240".parse().unwrap()));
        assert_eq!(listen_address("[::1]"), Ok("[::1]:3240".parse().unwrap()));
        assert!(listen_address("localhost:4000").is_ok_and(|a| a.port() == 4000 && a.ip().is_loopback()));
        assert!(listen_address("localhost").is_ok_and(|a| a.port() == 3240 && a.ip().is_loopback()));
        assert_eq!(listen_address("LocalHost.:7"), Ok("127.0.0.1:7".parse().unwrap()));
        assert!(listen_address("localhost:x").is_err());
        let error = listen_address("no-such-host.invalid:1").unwrap_err();
        assert!(error.contains("not an address or a host name"), "{error}");
    }

    #[test]
    fn a_bus_id_is_bus_dash_ports() {
        for good in ["0-1", "1-1.2", "3-10.4.1", "12-3"] {
            assert_eq!(bus_id(good), Ok(good.to_owned()));
        }
        for bad in [
            "",
            "abc",
            "1",
            "1-",
            "-1",
            "1-1.",
            "1-1..2",
            "a-1",
            "1-b",
            "1-1:1.0",
            " 1-1",
            "1-1-1",
            "0-123456789012345678901234567890",
        ] {
            let error = bus_id(bad).unwrap_err();
            assert!(error.contains("is not a bus id") && error.contains("0-1"), "{bad:?}: {error}");
        }
    }
}
