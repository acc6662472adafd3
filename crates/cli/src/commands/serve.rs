//! `usbwire serve`: build the devices the configuration names and serve them.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use usbwire_client::redir::{Source, WantedDevice};
use usbwire_device::DeviceFacts;
use usbwire_server::{AccessRules, Admission, PlainPolicy, Security, ServerConfig};
use usbwire_transport::access::Rule;
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

use super::common::local_server::{bind_unix_guest_socket, build, warn_if_open, DiskLinks};
use super::common::stdout::status_line;
use crate::args::ServeArgs;
use crate::config::{FileConfig, RedirListen, RedirRule, VirtualSpec};
use crate::exit::Failure;

pub(crate) async fn run(args: ServeArgs) -> Result<(), Failure> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path).map_err(Failure::config)?,
        None => FileConfig::default(),
    };
    let mut specs: Vec<VirtualSpec> = file.virtual_devices.iter().map(|entry| entry.spec.clone()).collect();
    for spec in &args.virtual_devices {
        specs.push(VirtualSpec::parse(spec).map_err(Failure::usage)?);
    }
    let registration = Registering::from(&args, &file)?;
    let Configured { config, redir_rules, tls_identity } = configure(&args, &file, specs.is_empty())?;
    let capture_dir = config.capture.as_ref().map(|c| c.dir.clone());
    // The first signal both stops the server and makes the registration
    // leave the lab registry (at once, while connections are still closing).
    let signal = super::common::process::shutdown_signal();
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        signal.await;
        let _ = stopping.send(());
    };
    let (server, exported) = build(config, &specs, DiskLinks::Follow)?;
    let bound = server.bind().await.map_err(Failure::from)?;
    print_serving(&bound, &exported, capture_dir.as_deref());
    let announce = !args.no_advertise && file.advertise.unwrap_or(true);
    warn_if_open(bound.local_addr(), bound.security(), announce);
    let advertising = if announce { advertise(&bound) } else { None };
    let bridges = start_redir_bridges(&redir_rules, bound.local_addr(), tls_identity.as_deref()).await?;
    let publishing = match registration {
        Some(registering) => {
            let registration = registering.finish(&file, &exported, &bound, tls_identity.as_deref())?;
            Some(start_publishing(registration, &bound, stopped))
        }
        None => None,
    };
    super::common::process::notify_ready();
    let reloading = tokio::spawn(reload_on_hangup(args.config.clone(), args.bind.clone(), file, bound.host_exports()));
    bound.run(shutdown).await;
    reloading.abort();
    bridges.iter().for_each(|bridge| bridge.abort());
    if let Some(task) = publishing {
        // Revoking its lease, for at most a couple of seconds.
        let _ = task.await;
    }
    if let Some(task) = advertising {
        task.abort();
    }
    Ok(())
}

/// What the flags and the config file make of the server, before anything starts.
struct Configured {
    config: ServerConfig,
    /// `[[redir]]` rules and `--redir` flags, checked against the security settings.
    redir_rules: Vec<RedirRule>,
    /// With TLS, the server's identity directory (its usbredir bridges and registration use it).
    tls_identity: Option<PathBuf>,
}

/// The runtime configuration from the flags (which win) and the config file: what to export,
/// where to listen, security, limits, the HTTP side, bind state, capture and resume.
/// `no_virtual_devices` says whether any `--virtual`/`[[virtual]]` device was named, for the
/// note that nothing is exported yet.
fn configure(args: &ServeArgs, file: &FileConfig, no_virtual_devices: bool) -> Result<Configured, Failure> {
    let mut config = ServerConfig {
        host_rules: file
            .bind
            .iter()
            .flat_map(|rule| std::iter::once(&rule.device).chain(&rule.also))
            .cloned()
            .collect(),
        ..ServerConfig::default()
    };
    for selector in &args.bind {
        config.host_rules.push(selector.parse().map_err(|e: usbwire_device::SelectorError| Failure::usage(e.into()))?);
    }
    if no_virtual_devices && config.host_rules.is_empty() {
        eprintln!(
            "note: nothing exported yet: `usbwire bind -b BUSID` exports a real device (see `usbwire list -l`); \
             --virtual SPEC adds a virtual one"
        );
    }
    if let Some(listen) = args.listen.or(file.listen) {
        config.listen = listen;
    }
    if let Some(control) = args.control.control.clone().or(file.control.clone()) {
        config.control_path = Some(control);
    }
    let mut redir_rules = file.redir.clone();
    for text in &args.redir {
        let rule: RedirRule = text.parse().map_err(Failure::usage)?;
        redir_rules.push(RedirRule { allow_unauthenticated: args.redir_tcp_unauthenticated, ..rule });
    }
    let (security, tls_identity) = security(args, file, &redir_rules)?;
    let plain_never = security.tls.is_some() && security.plain == PlainPolicy::Never;
    for rule in &redir_rules {
        rule.check(plain_never).map_err(Failure::config)?;
    }
    config.security = security;
    file.limits.apply(&mut config.limits, &mut config.budget).map_err(Failure::config)?;
    config.admission = file.admission.limits().map_err(Failure::config)?;
    config.metrics = args.metrics.or(file.metrics);
    config.http = args.http.or(file.http);
    config.http_hosts = file.http_hosts.clone();
    // `usbwire bind`s are kept in --bind-state, or beside the config file (server.toml → server.binds),
    // or in the user's state directory (/var/lib/usbwire/binds for root).
    config.bind_state = Some(
        args.bind_state
            .clone()
            .or_else(|| args.config.as_ref().map(|path| path.with_extension("binds")))
            .unwrap_or_else(usbwire_server::default_bind_state_path),
    );
    config.capture = args.capture.clone().or(file.capture.clone()).map(|dir| usbwire_server::CaptureConfig {
        max_bytes: file.capture_max_bytes.unwrap_or(usbwire_server::DEFAULT_CAPTURE_MAX_BYTES),
        ..usbwire_server::CaptureConfig::new(dir)
    });
    if let Some(secs) = args.resume_grace.or(file.resume_grace) {
        config.resume_grace = std::time::Duration::from_secs(secs);
    }
    Ok(Configured { config, redir_rules, tls_identity })
}

/// Where the server listens, what it exports and what else it serves, once it is bound.
fn print_serving(bound: &usbwire_server::BoundServer, exported: &[String], capture_dir: Option<&std::path::Path>) {
    status_line!("usbwire serving on {}", bound.local_addr());
    for line in exported {
        status_line!("  {line}");
    }
    if let Some(addr) = bound.metrics_addr() {
        status_line!("  metrics on http://{addr}/metrics");
    }
    if let Some(addr) = bound.http_addr() {
        status_line!("  status page on http://{addr}/");
    }
    if let Some(capture) = capture_dir {
        status_line!("  capturing imports into {}", capture.display());
    }
}

/// Publishes the server and its devices in the lab registry until `stopped` fires (the first
/// signal) or its sender is dropped (the server stopped without one).
fn start_publishing(
    registration: usbwire_lab::publish::Registration,
    bound: &usbwire_server::BoundServer,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<()> {
    status_line!("  registering in the lab registry {} as {}", registration.endpoint.url, registration.server.address);
    let stop = async move {
        let _ = stopped.await;
    };
    tokio::spawn(usbwire_lab::publish::publish(registration, bound.registry().clone(), stop))
}

/// `--registry` / `[registry]`, checked before anything starts.
struct Registering {
    endpoint: usbwire_lab::Endpoint,
    address: Option<String>,
    ttl: std::time::Duration,
}

impl Registering {
    fn from(args: &ServeArgs, file: &FileConfig) -> Result<Option<Self>, Failure> {
        let table = file.registry.clone().unwrap_or_default();
        let endpoint = match super::common::registry::endpoint(&args.registry)? {
            Some(endpoint) => endpoint,
            None if file.registry.is_some() => table.endpoint().map_err(Failure::config)?,
            None => return Ok(None),
        };
        let ttl = table.ttl.unwrap_or(usbwire_lab::DEFAULT_TTL);
        if ttl < std::time::Duration::from_secs(2) {
            return Err(Failure::config(anyhow::anyhow!("[registry] ttl must be at least 2s")));
        }
        Ok(Some(Self { endpoint, address: args.registry_address.clone().or(table.address), ttl }))
    }

    /// What to register, once the server is bound (its address) and has exported (labels by bus id).
    fn finish(
        self,
        file: &FileConfig,
        exported: &[String],
        bound: &usbwire_server::BoundServer,
        tls_identity: Option<&std::path::Path>,
    ) -> Result<usbwire_lab::publish::Registration, Failure> {
        let listening = bound.local_addr();
        let address = self.address.unwrap_or_else(|| {
            if listening.ip().is_unspecified() {
                format!("{}:{}", super::common::process::hostname(), listening.port())
            } else {
                listening.to_string()
            }
        });
        let tls_fingerprint = match tls_identity {
            Some(dir) => Some(
                usbwire_server::Identity::load_or_create(dir, &super::common::process::hostname())
                    .map_err(|e| Failure::config(anyhow::anyhow!("identity in {}: {e}", dir.display())))?
                    .0
                    .fingerprint()
                    .to_string(),
            ),
            None => None,
        };
        let security = bound.security();
        // [[virtual]] labels by the bus id each got (the lines follow the file's devices first).
        let mut labels: Vec<(usbwire_device::Selector, Vec<String>)> = file
            .virtual_devices
            .iter()
            .zip(exported)
            .filter(|(entry, _)| !entry.labels.is_empty())
            .filter_map(|(entry, line)| {
                let busid = line.split_whitespace().next()?;
                Some((usbwire_device::Selector::BusId(busid.to_owned()), entry.labels.clone()))
            })
            .collect();
        for rule in file.bind.iter().filter(|rule| !rule.labels.is_empty()) {
            for selector in std::iter::once(&rule.device).chain(&rule.also) {
                labels.push((selector.clone(), rule.labels.clone()));
            }
        }
        Ok(usbwire_lab::publish::Registration {
            endpoint: self.endpoint,
            ttl: self.ttl,
            server: usbwire_lab::ServerEntry {
                schema_version: usbwire_lab::entry::SCHEMA_VERSION,
                address,
                tls_fingerprint,
                plain: security.tls.is_none() || security.plain != PlainPolicy::Never,
                implementation: "usbwire".to_owned(),
                version: crate::version::VERSION.to_owned(),
                started_at: usbwire_lab::entry::timestamp(std::time::SystemTime::now()),
                catalog: true,
                catalog_terms: Vec::new(),
            },
            labels,
        })
    }
}

/// One usbredir bridge per `[[redir]]` rule, importing from this server over
/// loopback: plain, or with TLS when the server has it, as the server itself
/// (its identity, admitted for the rules' devices only, and its own key
/// pinned). The listening sockets are bound here (a Unix
/// socket 0600, or 0660 for the rule's group, in a checked directory), so a
/// path or port in use fails the start rather than a log line later.
async fn start_redir_bridges(
    rules: &[RedirRule],
    server: std::net::SocketAddr,
    tls_identity: Option<&std::path::Path>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, Failure> {
    let loopback: std::net::IpAddr =
        if server.is_ipv4() { std::net::Ipv4Addr::LOCALHOST.into() } else { std::net::Ipv6Addr::LOCALHOST.into() };
    let addr = if server.ip().is_unspecified() { std::net::SocketAddr::new(loopback, server.port()) } else { server };
    let security = match tls_identity {
        Some(dir) if !rules.is_empty() => {
            let (identity, _) = Identity::load_or_create(dir, &super::common::process::hostname())
                .with_context(|| format!("server identity in {}", dir.display()))
                .map_err(Failure::config)?;
            let known = KnownServers::in_dir(dir);
            known
                .add(&addr.to_string(), identity.fingerprint())
                .with_context(|| {
                    format!("pinning this server's key for its usbredir bridges in {}", known.path().display())
                })
                .map_err(Failure::config)?;
            usbwire_client::Security::Tls(Arc::new(usbwire_client::TlsClient {
                identity,
                known,
                trust_new: false,
                pinned: None,
            }))
        }
        _ => usbwire_client::Security::Plain,
    };
    let mut bridges = Vec::new();
    for rule in rules {
        let listener = bind_redir_listener(rule).await?;
        status_line!("  usbredir for {} on {}", rule.device, rule.listen);
        let selector = rule.device.clone();
        let device = WantedDevice::Matching {
            rule: rule.device.to_string(),
            matches: Arc::new(move |record, serial| selector.matches(&DeviceFacts::of_record(record, serial))),
        };
        let source =
            Source { addr, device, security: security.clone(), transforms: Vec::new(), follow: rule.follows() };
        bridges.push(tokio::spawn(async move {
            if let Err(error) = usbwire_client::redir::serve_listener(source, listener).await {
                tracing::error!(%error, "a usbredir bridge stopped");
            }
        }));
    }
    Ok(bridges)
}

/// The socket a `[[redir]]` rule's guests connect to.
async fn bind_redir_listener(rule: &RedirRule) -> Result<usbwire_client::redir::GuestListener, Failure> {
    match &rule.listen {
        RedirListen::Unix(path) => {
            let group = match &rule.group {
                Some(group) => Some(crate::config::group_id(group).map_err(Failure::config)?),
                None => None,
            };
            bind_unix_guest_socket(path, group, &format!("[[redir]] for {}", rule.device))
        }
        RedirListen::Tcp(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => Ok(listener.into()),
            Err(e) => Err(Failure::os(anyhow::anyhow!("[[redir]] for {}: cannot listen on {addr}: {e}", rule.device))),
        },
    }
}

/// SIGHUP re-reads the config file's `[[bind]]` rules: devices no rule wants
/// any more are withdrawn, newly matching ones exported, imports of the others
/// go on undisturbed. Other settings need a restart, and the log says so.
async fn reload_on_hangup(
    path: Option<std::path::PathBuf>,
    cli_rules: Vec<String>,
    started_with: FileConfig,
    hosts: usbwire_server::HostExports,
) {
    let Ok(mut hangups) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
    while hangups.recv().await.is_some() {
        let Some(path) = &path else {
            tracing::warn!("SIGHUP: started without --config, nothing to reload");
            continue;
        };
        let file = match FileConfig::load(path) {
            Ok(file) => file,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "SIGHUP: config not reloaded");
                continue;
            }
        };
        let mut rules: Vec<usbwire_device::Selector> =
            file.bind.iter().flat_map(|rule| std::iter::once(&rule.device).chain(&rule.also)).cloned().collect();
        rules.extend(cli_rules.iter().filter_map(|text| text.parse().ok()));
        let others_changed =
            FileConfig { bind: Vec::new(), ..file.clone() } != FileConfig { bind: Vec::new(), ..started_with.clone() };
        let hosts = hosts.clone();
        match tokio::task::spawn_blocking(move || hosts.reload_rules(rules)).await {
            Ok((exported, withdrawn)) => tracing::info!(?exported, ?withdrawn, "SIGHUP: bind rules reloaded"),
            Err(error) => tracing::warn!(%error, "SIGHUP: reload failed"),
        }
        if others_changed {
            tracing::warn!("SIGHUP: only [[bind]] rules are reloaded; restart the server for the other changes");
        }
    }
}

/// Announces the server with DNS-SD (`_usbip._tcp`) and keeps its device
/// count current. Not when it listens on loopback only: nobody else could connect.
fn advertise(bound: &usbwire_server::BoundServer) -> Option<tokio::task::JoinHandle<()>> {
    let addr = bound.local_addr();
    if addr.ip().is_loopback() {
        tracing::info!("listening on loopback only: not advertising");
        return None;
    }
    let config_tls = bound.security();
    let tls = match (config_tls.tls.is_some(), config_tls.plain) {
        (false, _) => usbwire_discovery::TlsMode::Off,
        (true, PlainPolicy::Always) => usbwire_discovery::TlsMode::Optional,
        (true, _) => usbwire_discovery::TlsMode::Required,
    };
    let registry = bound.registry().clone();
    let announcement = usbwire_discovery::Announcement {
        name: format!("{}-{}", super::common::process::hostname(), addr.port()),
        port: addr.port(),
        tls,
        devices: registry.len(),
    };
    let mut advertisement = match usbwire_discovery::advertise(announcement) {
        Ok(advertisement) => advertisement,
        Err(error) => {
            tracing::warn!(%error, "cannot advertise with mDNS (clients can still connect by address)");
            return None;
        }
    };
    status_line!("advertised as {} (mDNS; --no-advertise to stay quiet)", advertisement.fullname());
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            if let Err(error) = advertisement.set_devices(registry.len()) {
                tracing::warn!(%error, "mDNS update failed");
            }
        }
    }))
}

/// TLS, plain policy and access rules from flags and the config file, and
/// with TLS the identity directory. With `redir` rules the server's own key
/// is admitted (its `[[redir]]` bridges connect as the server) for the
/// devices those rules select, and nothing else.
fn security(args: &ServeArgs, file: &FileConfig, redir: &[RedirRule]) -> Result<(Security, Option<PathBuf>), Failure> {
    if !(args.tls || file.tls) {
        if !args.allow.is_empty() || !file.allow.is_empty() || args.allow_plain.is_some() || args.allow_any_client {
            return Err(Failure::usage(anyhow::anyhow!(
                "--allow, --allow-plain, --allow-any-client and [[allow]] rules need --tls (or tls = true)"
            )));
        }
        return Ok((Security::default(), None));
    }
    check_any_client(args, file)?;
    let dir = args
        .identity
        .clone()
        .or_else(|| file.identity.clone())
        .unwrap_or_else(usbwire_transport::identity::default_dir);
    let (identity, created) = Identity::load_or_create(&dir, &super::common::process::hostname())
        .with_context(|| format!("server identity in {}", dir.display()))
        .map_err(Failure::config)?;
    if created {
        status_line!("created server identity in {}", dir.display());
    }
    status_line!("server key fingerprint {} (clients pin it on first use)", identity.fingerprint());
    let plain = match args.allow_plain.as_deref().or(file.allow_plain.as_deref()).unwrap_or("loopback") {
        "never" => PlainPolicy::Never,
        "loopback" => PlainPolicy::Loopback,
        "always" => PlainPolicy::Always,
        other => return Err(Failure::usage(anyhow::anyhow!("--allow-plain {other:?}: use never, loopback or always"))),
    };
    let mut rules = file.allow.clone();
    for fingerprint in &args.allow {
        rules.push(Rule { client: fingerprint.clone(), devices: vec!["*".into()] });
    }
    let mut access = AccessRules { rules };
    let invalid = access.invalid_clients();
    if !invalid.is_empty() {
        return Err(Failure::config(anyhow::anyhow!(
            "not fingerprints or ca:NAME: {} (use the sha256:… that `usbwire identity` prints on the client)",
            invalid.join(", ")
        )));
    }
    if access.rules.is_empty() {
        eprintln!("usbwire: no client is allowed yet: add --allow FINGERPRINT (from `usbwire identity` on the client)");
    }
    if !redir.is_empty() {
        // The TLS handshake admits the server's key; which devices it gets is `own_bridges`.
        access.rules.push(Rule { client: identity.fingerprint().to_string(), devices: Vec::new() });
    }
    let ca = match args.ca.as_ref().or(file.ca.as_ref()) {
        Some(path) => Some(usbwire_transport::ca::TrustedCa::load(path).map_err(|e| Failure::config(e.into()))?),
        None => None,
    };
    if ca.is_none() && access.rules.iter().any(|r| r.ca_name().is_some()) {
        return Err(Failure::config(anyhow::anyhow!("ca:NAME rules need the CA: pass --ca PATH (or ca = \"PATH\")")));
    }
    let mut security =
        Security::tls(&identity, plain, Admission { rules: access, ca }).map_err(|e| Failure::software(e.into()))?;
    if !redir.is_empty() {
        security.own_bridges = Some(usbwire_server::OwnBridges {
            identity: identity.fingerprint(),
            devices: redir.iter().map(|rule| rule.device.clone()).collect(),
        });
    }
    Ok((security, Some(dir)))
}

/// `*` rules admit any self-made key, i.e. whoever reaches the port: only with
/// `--allow-any-client` (or `allow_any_client = true`), so nobody does it by accident.
fn check_any_client(args: &ServeArgs, file: &FileConfig) -> Result<(), Failure> {
    if args.allow_any_client || file.allow_any_client {
        return Ok(());
    }
    if args.allow.iter().any(|c| c == "*") {
        return Err(Failure::usage(anyhow::anyhow!(
            "--allow '*' admits any client with any self-made key, i.e. anyone who reaches the port; \
                 add --allow-any-client if that is what you want, or --allow each client's fingerprint \
                 (`usbwire identity` on the client prints it)"
        )));
    }
    if file.allow.iter().any(|r| r.client == "*") {
        return Err(Failure::config(anyhow::anyhow!(
            "[[allow]] client = \"*\" admits any client with any self-made key, i.e. anyone who reaches the \
                 port; add allow_any_client = true (or --allow-any-client) if that is what you want, or name each \
                 client's fingerprint (`usbwire identity` on the client prints it)"
        )));
    }
    Ok(())
}
