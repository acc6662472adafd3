use std::os::unix::fs::PermissionsExt as _;

use usbwire_client::follow::FollowStatus;
use usbwire_client::relay::RelayState;

use super::{relay_status_in, RelayStatusFile};

fn status(port: u32) -> FollowStatus {
    FollowStatus {
        port,
        attached: true,
        reattached: 0,
        vendor_id: 0x1209,
        product_id: 0x0003,
        relay: RelayState::Connected,
        storage: None,
    }
}

/// Links planted at the status file's name or at any name it writes first
/// are replaced, never followed: the file they point at stays as it was.
#[test]
fn a_planted_link_is_replaced_not_followed_and_the_file_is_gone_with_the_relay() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let status_path = dir.path().join("usbwire-port3.json");
    std::os::unix::fs::symlink(&victim, &status_path).unwrap();
    for name in ["usbwire-port3.tmp", &format!("usbwire-port3.json.{}.new", std::process::id())] {
        let _ = std::os::unix::fs::symlink(&victim, dir.path().join(name));
    }
    let server = "10.0.0.5:3240".parse().unwrap();
    let file = RelayStatusFile::create_in(dir.path(), status(3), server, None);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let meta = std::fs::symlink_metadata(&status_path).unwrap();
    assert!(meta.file_type().is_file(), "the link was replaced by the file");
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    let shown = relay_status_in(dir.path(), 3).expect("this process is alive");
    assert_eq!(shown["server"], "10.0.0.5:3240");
    assert_eq!(shown["state"], "connected");
    drop(file);
    assert!(!status_path.exists(), "removed when the relay ends");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
}
