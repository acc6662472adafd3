//! `etcd://HOST:PORT[,HOST:PORT…][/PREFIX]`: where the lab registry is and
//! under which key prefix, as `--registry` takes it.

use std::fmt;
use std::str::FromStr;

/// etcd's client port when a `--registry` endpoint names none.
pub const DEFAULT_ETCD_PORT: u16 = 2379;
/// The key prefix when a `--registry` URL names none.
pub const DEFAULT_PREFIX: &str = "usbwire";

/// A parsed `--registry` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryUrl {
    /// `HOST:PORT` of each etcd member to try.
    pub endpoints: Vec<String>,
    /// The key prefix, without leading or trailing `/` (`usbwire`, `lab/bench-3`).
    pub prefix: String,
}

/// Why a `--registry` value is not a registry URL.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{text:?} is not a lab registry: {why}; expected etcd://HOST:PORT[,HOST:PORT…][/PREFIX], e.g. etcd://10.0.0.5:2379/usbwire")]
pub struct UrlError {
    text: String,
    why: &'static str,
}

impl RegistryUrl {
    /// The endpoints as the etcd client takes them.
    pub fn endpoint_urls(&self, tls: bool) -> Vec<String> {
        let scheme = if tls { "https" } else { "http" };
        self.endpoints.iter().map(|endpoint| format!("{scheme}://{endpoint}")).collect()
    }
}

impl FromStr for RegistryUrl {
    type Err = UrlError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = |why| UrlError { text: text.to_owned(), why };
        let rest = text.strip_prefix("etcd://").ok_or_else(|| error("it does not start with etcd://"))?;
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let prefix = if prefix.is_empty() { DEFAULT_PREFIX } else { prefix };
        if prefix.split('/').any(str::is_empty) || prefix.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(error("the prefix has an empty part, a space or a control character"));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            if host.is_empty() || host.chars().any(|c| c.is_control() || c.is_whitespace() || c == '@') {
                return Err(error("an endpoint is empty or not a HOST:PORT"));
            }
            // `[::1]:2379`, `[::1]`, `host:2379`, `host`.
            let has_port = match host.rfind(']') {
                Some(end) => host[end..].contains(':'),
                None => host.contains(':'),
            };
            if has_port {
                let port = host.rsplit(':').next().unwrap_or_default();
                if port.parse::<u16>().map_or(true, |p| p == 0) {
                    return Err(error("an endpoint's port is not a number from 1 to 65535"));
                }
                endpoints.push(host.to_owned());
            } else {
                endpoints.push(format!("{host}:{DEFAULT_ETCD_PORT}"));
            }
        }
        Ok(Self { endpoints, prefix: prefix.to_owned() })
    }
}

impl fmt::Display for RegistryUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd://{}/{}", self.endpoints.join(","), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_and_prefix() {
        let url: RegistryUrl = "etcd://10.0.0.5:2379,10.0.0.6:2380/lab/bench".parse().unwrap();
        assert_eq!(url.endpoints, ["10.0.0.5:2379", "10.0.0.6:2380"]);
        assert_eq!(url.prefix, "lab/bench");
        assert_eq!(url.to_string(), "etcd://10.0.0.5:2379,10.0.0.6:2380/lab/bench");
        assert_eq!(url.endpoint_urls(false), ["http://10.0.0.5:2379", "http://10.0.0.6:2380"]);
        assert_eq!(url.endpoint_urls(true)[0], "https://10.0.0.5:2379");
    }

    #[test]
    fn fills_in_the_default_port_and_prefix() {
        let url: RegistryUrl = "etcd://etcd.lab".parse().unwrap();
        assert_eq!(url.endpoints, ["etcd.lab:2379"]);
        assert_eq!(url.prefix, "usbwire");
        let url: RegistryUrl = "etcd://[::1],[::1]:3000/".parse().unwrap();
        assert_eq!(url.endpoints, ["[::1]:2379", "[::1]:3000"]);
        assert_eq!(url.prefix, "usbwire");
    }

    #[test]
    fn refuses_what_is_not_a_registry() {
        for bad in [
            "http://10.0.0.5:2379",
            "10.0.0.5:2379",
            "etcd://",
            "etcd://a:2379,,b:2379",
            "etcd://a:0",
            "etcd://a:x",
            "etcd://a:2379/lab//x",
            "etcd://user@a:2379",
            "etcd://a:2379/with space",
        ] {
            let error = bad.parse::<RegistryUrl>().unwrap_err().to_string();
            assert!(error.contains("expected etcd://HOST:PORT"), "{bad}: {error}");
        }
    }
}
