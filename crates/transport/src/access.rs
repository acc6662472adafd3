//! Which client may see and import which device.
//!
//! Rules come from the server's configuration:
//!
//! ```toml
//! [[allow]]
//! client = "sha256:…"          # a client fingerprint, or "*" for any authenticated client
//! devices = ["1-1", "disk"]     # bus ids or device kinds; "*" for all
//! ```
//!
//! A client sees and may import exactly the devices some rule gives it.
//! Plain (non-TLS) connections, where the policy admits them, are matched by
//! `client = "plain"`.

use serde::Deserialize;

use crate::Fingerprint;

/// Who is asking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientId {
    /// A TLS client with this certificate fingerprint.
    Certificate(Fingerprint),
    /// A plain USB/IP client (admitted by the plain-connection policy).
    Plain,
}

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Certificate(fp) => fp.fmt(f),
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
        self.rules.iter().any(|rule| {
            let client_matches = match client {
                ClientId::Plain => rule.client == "plain",
                ClientId::Certificate(fp) => {
                    rule.client == "*" || rule.client.parse::<Fingerprint>().is_ok_and(|wanted| wanted == *fp)
                }
            };
            client_matches && rule.devices.iter().any(|d| d == "*" || d == busid || d == kind)
        })
    }

    /// Whether `client` is named by any rule at all (an unknown client is refused outright).
    pub fn knows(&self, client: &ClientId) -> bool {
        self.rules.iter().any(|rule| match client {
            ClientId::Plain => rule.client == "plain",
            ClientId::Certificate(fp) => {
                rule.client == "*" || rule.client.parse::<Fingerprint>().is_ok_and(|w| w == *fp)
            }
        })
    }

    /// Fingerprints that fail to parse, for a configuration error at startup.
    pub fn invalid_clients(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|r| &r.client)
            .filter(|c| *c != "*" && *c != "plain" && c.parse::<Fingerprint>().is_err())
            .cloned()
            .collect()
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
