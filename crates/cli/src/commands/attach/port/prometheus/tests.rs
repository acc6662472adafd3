use serde_json::json;

use super::{render, RelayedPort};

#[test]
fn each_relayed_port_has_its_state_and_the_accelerated_ones_their_counters() {
    let ports = [
        RelayedPort {
            port: 0,
            busid: "1-1".into(),
            relay: json!({
                "pid": 7, "server": "10.0.2.2:3240", "state": "connected",
                "storage": {
                    "commands_pipelined": 119, "statuses_ahead": 118, "statuses_wasted": 1,
                    "read_ahead_hits": 93, "bytes_read_ahead": 97517568, "bytes_wasted": 16787456,
                    "scan_hits": 16
                }
            }),
        },
        RelayedPort {
            port: 8,
            busid: "2-\"odd\\".into(),
            relay: json!({ "pid": 9, "server": "[::1]:3240", "state": "resuming", "resuming_since": 1 }),
        },
    ];
    let text = render(&ports);
    let expected = [
        "# HELP usbwire_port_relay_connected 1 while the port's relay is connected to its server, 0 while it resumes.",
        "# TYPE usbwire_port_relay_connected gauge",
        r#"usbwire_port_relay_connected{port="0",server="10.0.2.2:3240",busid="1-1"} 1"#,
        r#"usbwire_port_relay_connected{port="8",server="[::1]:3240",busid="2-\"odd\\"} 0"#,
        "# HELP usbwire_port_storage_commands_pipelined_total Mass-storage commands whose command block was \
         answered at once (one round trip a command).",
        "# TYPE usbwire_port_storage_commands_pipelined_total counter",
        r#"usbwire_port_storage_commands_pipelined_total{port="0",server="10.0.2.2:3240",busid="1-1"} 119"#,
    ];
    for (line, want) in text.lines().zip(expected) {
        assert_eq!(line, want);
    }
    for (metric, value) in [
        ("usbwire_port_storage_statuses_ahead_total", 118),
        ("usbwire_port_storage_statuses_wasted_total", 1),
        ("usbwire_port_storage_read_ahead_hits_total", 93),
        ("usbwire_port_storage_read_ahead_bytes_total", 97_517_568),
        ("usbwire_port_storage_read_ahead_wasted_bytes_total", 16_787_456),
        ("usbwire_port_storage_scan_ahead_hits_total", 16),
    ] {
        let sample = format!("{metric}{{port=\"0\",server=\"10.0.2.2:3240\",busid=\"1-1\"}} {value}");
        assert!(text.lines().any(|line| line == sample), "{sample} missing from\n{text}");
        assert!(text.contains(&format!("# TYPE {metric} counter\n")));
    }
    // The port without the accelerator has no storage samples.
    assert_eq!(text.matches("port=\"8\"").count(), 1, "{text}");
    // Every family is announced once, every sample line is `name{labels} value`.
    assert_eq!(text.matches("# TYPE ").count(), 8);
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let (_, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<u64>().is_ok(), "{line}");
    }
}

#[test]
fn no_relayed_port_is_the_families_alone() {
    let text = render(&[]);
    assert_eq!(text.lines().filter(|line| !line.starts_with('#')).count(), 0, "{text}");
    assert_eq!(text.matches("# TYPE ").count(), 8);
}
