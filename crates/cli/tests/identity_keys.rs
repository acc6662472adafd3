//! `usbwire identity` never replaces a key without `--force`, through the
//! real binary: a second `--ca-create` would have orphaned every certificate
//! the CA issued, a second `--ca-issue` into a server's directory would have
//! replaced its key. With `--force` the old files stay as `NAME.old`, and
//! `openssl verify` still accepts an old certificate against the kept CA.
//! Suggested commands carry the directory the user named.

use std::path::Path;
use std::process::{Command, Output};

use usbwire_testing::process::scratch;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn identity(args: &[&str], dir: &Path) -> Output {
    Command::new(BIN).arg("identity").args(args).current_dir(dir).output().expect("usbwire runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `openssl verify -CAfile CA CERT` succeeds.
fn openssl_verifies(ca: &Path, certificate: &Path) -> bool {
    let out = Command::new("openssl").arg("verify").arg("-CAfile").arg(ca).arg(certificate).output().expect("openssl");
    out.status.success()
}

#[test]
fn a_second_ca_create_is_refused_and_force_keeps_the_old_ca() {
    let base = scratch("identity-keys", "ca");
    let created = identity(&["--dir", "ca", "--ca-create", "fleet"], &base);
    assert!(created.status.success(), "{}", text(&created));
    let issued = identity(&["--ca", "ca", "--ca-issue", "bob", "--dir", "bob"], &base);
    assert!(issued.status.success(), "{}", text(&issued));
    assert!(openssl_verifies(&base.join("ca/ca.crt"), &base.join("bob/identity.crt")));
    let ca_key = read(&base.join("ca/ca.key"));

    let again = identity(&["--dir", "ca", "--ca-create", "fleet"], &base);
    assert_eq!(again.status.code(), Some(73), "{}", text(&again));
    assert!(text(&again).contains("already exists") && text(&again).contains("--force"), "{}", text(&again));
    assert_eq!(read(&base.join("ca/ca.key")), ca_key, "the CA key is untouched");
    assert!(openssl_verifies(&base.join("ca/ca.crt"), &base.join("bob/identity.crt")), "bob still verifies");

    let forced = identity(&["--dir", "ca", "--ca-create", "fleet", "--force"], &base);
    assert!(forced.status.success(), "{}", text(&forced));
    assert!(text(&forced).contains("kept as ca/ca.key.old"), "{}", text(&forced));
    assert_ne!(read(&base.join("ca/ca.key")), ca_key, "a new CA");
    assert_eq!(read(&base.join("ca/ca.key.old")), ca_key, "the old key is kept");
    assert!(!openssl_verifies(&base.join("ca/ca.crt"), &base.join("bob/identity.crt")), "the new CA did not issue bob");
    assert!(openssl_verifies(&base.join("ca/ca.crt.old"), &base.join("bob/identity.crt")), "the kept one did");
    let mut names: Vec<String> = std::fs::read_dir(base.join("ca"))
        .expect("ca dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["ca.crt", "ca.crt.old", "ca.key", "ca.key.old"], "no temporary file left");
}

#[test]
fn issuing_into_an_identity_directory_is_refused_without_force() {
    let base = scratch("identity-keys", "issue");
    assert!(identity(&["--dir", "ca", "--ca-create", "fleet"], &base).status.success());
    let server = identity(&["--dir", "server", "--create"], &base);
    assert!(server.status.success(), "{}", text(&server));
    let fingerprint = String::from_utf8_lossy(&server.stdout).lines().last().unwrap_or_default().to_owned();
    let server_key = read(&base.join("server/identity.key"));

    let issued = identity(&["--ca", "ca", "--ca-issue", "bob", "--dir", "server"], &base);
    assert_eq!(issued.status.code(), Some(73), "{}", text(&issued));
    assert_eq!(read(&base.join("server/identity.key")), server_key, "the server's key is untouched");
    let shown = identity(&["--dir", "server"], &base);
    assert_eq!(String::from_utf8_lossy(&shown.stdout).trim(), fingerprint);

    // --create on an existing identity shows it; with --force it makes a new one and keeps the old.
    let kept = identity(&["--dir", "server", "--create"], &base);
    assert_eq!(String::from_utf8_lossy(&kept.stdout).trim(), fingerprint, "{}", text(&kept));
    let renewed = identity(&["--dir", "server", "--create", "--force", "--json"], &base);
    assert!(renewed.status.success(), "{}", text(&renewed));
    let json: serde_json::Value = serde_json::from_slice(&renewed.stdout).expect("json");
    assert_ne!(json["fingerprint"].as_str(), Some(fingerprint.as_str()));
    assert_eq!(json["kept"][0].as_str(), Some("server/identity.key.old"), "{json}");
    assert_eq!(read(&base.join("server/identity.key.old")), server_key);
}

#[test]
fn suggestions_carry_the_directory_the_user_named_and_a_ca_is_recognised() {
    let base = scratch("identity-keys", "advice");
    let missing = identity(&["--dir", "elsewhere"], &base);
    assert_eq!(missing.status.code(), Some(69), "{}", text(&missing));
    assert!(text(&missing).contains("usbwire identity --create --dir elsewhere"), "{}", text(&missing));

    assert!(identity(&["--dir", "ca", "--ca-create", "fleet"], &base).status.success());
    let ca = identity(&["--dir", "ca"], &base);
    assert_eq!(ca.status.code(), Some(69), "{}", text(&ca));
    assert!(text(&ca).contains("ca holds a CA"), "{}", text(&ca));
    assert!(text(&ca).contains("--ca ca --ca-issue NAME"), "{}", text(&ca));

    let no_ca = identity(&["--ca", "nothing", "--ca-issue", "bob", "--dir", "bob"], &base);
    assert_eq!(no_ca.status.code(), Some(69), "{}", text(&no_ca));
    assert!(text(&no_ca).contains("usbwire identity --dir nothing --ca-create NAME"), "{}", text(&no_ca));
}

#[test]
fn keys_are_not_written_into_a_directory_others_may_write_to() {
    use std::os::unix::fs::PermissionsExt as _;
    let base = scratch("identity-keys", "shared");
    let shared = base.join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let out = identity(&["--dir", "shared", "--ca-create", "fleet"], &base);
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("writable by other users") && text(&out).contains("mkdir -m 700"), "{}", text(&out));
    assert!(!text(&out).contains("chmod"), "{}", text(&out));
    assert_eq!(std::fs::read_dir(&shared).expect("dir").count(), 0, "nothing written");
}
