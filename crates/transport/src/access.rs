//! Which client may see and import which device.
//!
//! Rules come from the server's configuration:
//!
//! ```toml
//! [[allow]]
//! client = "sha256:…"          # a client fingerprint, or "*" for any client key at all
//!                               # (self-made ones too: `usbwire serve` wants --allow-any-client)
//! devices = ["1-1", "disk"]     # bus ids or device kinds; "*" for all
//! ```
//!
//! A client sees and may import exactly the devices some rule gives it.
//! Plain (non-TLS) connections, where the policy admits them, are matched by
//! `client = "plain"` (and by nothing else: `*` means any TLS client).

use rustls::pki_types::CertificateDer;
use rustls::CertificateError;
use serde::Deserialize;

use crate::ca::TrustedCa;
use crate::Fingerprint;

/// Who is asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientId {
    /// A TLS client with this certificate fingerprint.
    Certificate(Fingerprint),
    /// A TLS client whose certificate the server's CA issued for `name`
    /// (matched by `client = "ca:NAME"` rules, and by its fingerprint too).
    CaIssued { fingerprint: Fingerprint, name: String },
    /// A plain USB/IP client (admitted by the plain-connection policy).
    Plain,
}

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Certificate(fp) => fp.fmt(f),
            Self::CaIssued { fingerprint, name } => write!(f, "ca:{name} ({fingerprint})"),
            Self::Plain => f.write_str("plain"),
        }
    }
}

/// One `[[allow]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub client: String,
    pub devices: Vec<String>,
}

impl Rule {
    /// Whether this rule's `client` names `client`.
    fn names(&self, client: &ClientId) -> bool {
        let by_fingerprint = |fp: &Fingerprint| {
            self.client == "*" || self.client.parse::<Fingerprint>().is_ok_and(|wanted| wanted == *fp)
        };
        match client {
            ClientId::Plain => self.client == "plain",
            ClientId::Certificate(fp) => by_fingerprint(fp),
            ClientId::CaIssued { fingerprint, name } => {
                by_fingerprint(fingerprint) || self.client.strip_prefix("ca:") == Some(name.as_str())
            }
        }
    }

    /// The CA-issued name this rule admits (`client = "ca:NAME"`).
    pub fn ca_name(&self) -> Option<&str> {
        self.client.strip_prefix("ca:").filter(|n| !n.is_empty())
    }
}

/// The rules, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct AccessRules {
    pub rules: Vec<Rule>,
}

impl AccessRules {
    /// Allows everyone everything (a server without TLS).
    pub fn open() -> Self {
        Self {
            rules: vec![
                Rule { client: "*".into(), devices: vec!["*".into()] },
                Rule { client: "plain".into(), devices: vec!["*".into()] },
            ],
        }
    }

    /// Whether `client` may see and import the device `busid` of kind `kind`.
    pub fn allows(&self, client: &ClientId, busid: &str, kind: &str) -> bool {
        self.rules
            .iter()
            .any(|rule| rule.names(client) && rule.devices.iter().any(|d| d == "*" || d == busid || d == kind))
    }

    /// Whether `client` is named by any rule at all (an unknown client is refused outright).
    pub fn knows(&self, client: &ClientId) -> bool {
        self.rules.iter().any(|rule| rule.names(client))
    }

    /// Fingerprints that fail to parse, for a configuration error at startup.
    pub fn invalid_clients(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|r| &r.client)
            .filter(|c| {
                *c != "*"
                    && *c != "plain"
                    && c.parse::<Fingerprint>().is_err()
                    && c.strip_prefix("ca:").is_none_or(str::is_empty)
            })
            .cloned()
            .collect()
    }
}

/// Who may connect over TLS at all: the rules, and the CA behind their
/// `ca:NAME` clients. The TLS handshake asks it, so a refused client is told
/// why by an alert (access denied, certificate expired) instead of a bare
/// hang-up, and never reaches the USB/IP exchange.
#[derive(Clone, Debug, Default)]
pub struct Admission {
    pub rules: AccessRules,
    pub ca: Option<TrustedCa>,
}

impl Admission {
    /// Who the client presenting `leaf` is, if some rule admits it; otherwise
    /// why not: the CA's reason when the certificate is the CA's for a name a
    /// rule admits but not valid now, else `ApplicationVerificationFailure`
    /// (sent as "access denied").
    pub fn identify(&self, leaf: &CertificateDer<'_>) -> Result<ClientId, CertificateError> {
        let fingerprint = Fingerprint::of(leaf);
        let mut refusal = CertificateError::ApplicationVerificationFailure;
        if let Some(ca) = &self.ca {
            for name in self.rules.rules.iter().filter_map(Rule::ca_name) {
                match ca.check(leaf, name) {
                    Ok(()) => return Ok(ClientId::CaIssued { fingerprint, name: name.to_owned() }),
                    Err(error @ (CertificateError::Expired | CertificateError::NotValidYet)) => refusal = error,
                    Err(_) => {}
                }
            }
        }
        let client = ClientId::Certificate(fingerprint);
        if self.rules.knows(&client) {
            Ok(client)
        } else {
            Err(refusal)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_by_fingerprint_busid_and_kind() {
        let alice = Fingerprint([0xaa; 32]);
        let bob = Fingerprint([0xbb; 32]);
        let rules = AccessRules {
            rules: vec![
                Rule { client: alice.to_string(), devices: vec!["1-1".into()] },
                Rule { client: "*".into(), devices: vec!["loopback".into()] },
            ],
        };
        let a = ClientId::Certificate(alice);
        let b = ClientId::Certificate(bob);
        assert!(rules.allows(&a, "1-1", "keyboard"));
        assert!(!rules.allows(&b, "1-1", "keyboard"));
        assert!(rules.allows(&b, "1-4", "loopback"));
        assert!(!rules.allows(&ClientId::Plain, "1-4", "loopback"));
        assert!(rules.knows(&b));
        assert!(!rules.knows(&ClientId::Plain));
        assert!(AccessRules::open().allows(&ClientId::Plain, "2-1", "disk"));
        let bad = AccessRules { rules: vec![Rule { client: "sha256:xyz".into(), devices: vec![] }] };
        assert_eq!(bad.invalid_clients(), vec!["sha256:xyz".to_string()]);
    }
}
