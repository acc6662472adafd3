//! `usbwire demo`: the commands it prints work as printed.

use std::process::Command;

use usbwire_testing::process::{free_addr, scratch, start};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

/// A demo started with `--control` printed `usbwire type …` and `usbwire
/// state` without it, so both missed its socket ("is `usbwire serve`
/// running?"). Each follow-up line is run through the shell as printed.
#[test]
fn the_follow_up_commands_reach_a_demo_started_with_control() {
    let dir = scratch("demo", "control");
    // A path a shell would split, to check the quoting too.
    let control = dir.join("my socket").join("control.sock");
    let mut command = Command::new(BIN);
    command
        .args(["demo", "--listen", &free_addr().to_string(), "--dir"])
        .arg(dir.join("files"))
        .arg("--control")
        .arg(&control);
    // Its last line before serving on: the disk image and Ctrl-C.
    let running = start(command, "Disk image:").ready();
    let lines = running.printed();
    let follow_ups: Vec<&str> = lines
        .iter()
        .map(|line| line.trim_start())
        .filter(|line| line.starts_with("usbwire type") || line.starts_with("usbwire state"))
        .map(|line| line.split(" # ").next().unwrap_or(line).trim_end())
        .collect();
    assert_eq!(follow_ups.len(), 2, "{lines:#?}");
    for line in follow_ups {
        assert!(line.contains("--control"), "{line}");
        let as_printed = line.replacen("usbwire", BIN, 1);
        let out = Command::new("sh").args(["-c", &as_printed]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("cannot reach"), "{line}: {stderr}");
        if line.starts_with("usbwire state") {
            assert!(out.status.success(), "{line}: {stderr}");
            let table = String::from_utf8_lossy(&out.stdout);
            assert!(table.contains("keyboard") && table.contains("disk") && table.contains("serial"), "{table}");
        } else {
            // It reached the demo, whose keyboard no host has attached yet.
            assert_eq!(out.status.code(), Some(69), "{line}: {stderr}");
            assert!(stderr.contains("not attached"), "{line}: {stderr}");
        }
    }
    running.stop();
}
