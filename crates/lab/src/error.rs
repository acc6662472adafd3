//! [`LabError`]: what went wrong with the registry, with a hint of what to
//! check when etcd could not be reached. Not for a selector or a registry URL
//! that does not parse (`WantError`, `UrlError`, beside what they parse).

/// What went wrong with the registry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LabError {
    /// No etcd member answered: the cluster is down, `--registry` names the
    /// wrong place, or TLS towards it failed.
    #[error("lab registry {url} unreachable: {reason} ({})", unreachable_hint(.reason, *.tls))]
    Unreachable { url: String, reason: String, tls: bool },
    /// A request reached etcd and failed.
    #[error("lab registry request failed: {0}")]
    Request(#[from] etcd_client::Error),
    /// The TLS files for etcd could not be read.
    #[error("TLS for the lab registry: {0}")]
    Tls(String),
    /// No registered device matches the selector at all.
    #[error("no device in the lab registry matches {want}")]
    NoMatch { want: String },
    /// Devices match, but every one is reserved or in use.
    #[error(
        "no free device matches {want}: all {matching} matching are taken ({reserved} reserved, {in_use} in use without a reservation); try again later"
    )]
    NoneFree { want: String, matching: usize, reserved: usize, in_use: usize },
    /// The lease that held a registration or reservation ended (etcd unreachable for its time to live).
    #[error("lease {lease:x} lost: {reason}")]
    LeaseLost { lease: i64, reason: String },
    /// `release` named a reservation that does not exist (or is not ours).
    #[error("{what} is not reserved{by}")]
    NotReserved { what: String, by: String },
}

/// What to check, from why etcd could not be reached.
fn unreachable_hint(reason: &str, tls: bool) -> &'static str {
    let reason = reason.to_ascii_lowercase();
    if reason.contains("certificate") || reason.contains("alert") {
        "TLS towards etcd failed: check --registry-ca, --registry-cert and --registry-key (or [registry] ca, cert, key)"
    } else if tls {
        "is etcd running there, with TLS? check --registry, and --registry-ca, --registry-cert and --registry-key"
    } else {
        "is etcd running there? check --registry"
    }
}

impl LabError {
    /// The registry could not be reached (as opposed to: it answered no).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Unreachable { .. } | Self::Request(_) | Self::LeaseLost { .. })
    }
}
