//! The manual as a person reads it: `usbwire man --dir` pages rendered by
//! man(1) (`man -l`, man-db) with their EXAMPLES, EXIT STATUS, ENVIRONMENT,
//! FILES and SEE ALSO sections, usbwire.toml(5) with the configuration keys,
//! no page for a `help` verb, and `--help` with the same examples and every
//! `--json` described.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().expect("usbwire runs");
    assert!(out.status.success(), "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// What man(1) shows of a page file (bold and underline overstrikes removed); `None` without man.
fn man(page: &Path) -> Option<String> {
    let out = Command::new("man")
        .arg("-l")
        .arg(page)
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .env("MANWIDTH", "100")
        .output()
        .ok()?;
    assert!(out.status.success(), "man -l {}: {}", page.display(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // "X\bX" (bold) and "_\bX" (underline) as plain X.
    let mut plain = String::new();
    for c in text.chars() {
        if c == '\u{8}' {
            plain.pop();
        } else {
            plain.push(c);
        }
    }
    Some(plain)
}

#[test]
fn man_pages_render_with_examples_exit_status_environment_and_files() {
    let dir = usbwire_testing::process::scratch("manual", "pages");
    let written = usbwire(&["man", "--dir", dir.to_str().expect("path")]);
    assert!(written.contains("usbwire.toml.5") && written.contains("usbwire-bind.1"), "{written}");
    assert!(!dir.join("usbwire-help.1").exists(), "there is no help verb to have a page");
    // Into a man1 directory: section 5 goes where man looks for it.
    let man1 = dir.join("share/man/man1");
    usbwire(&["man", "--dir", man1.to_str().expect("path")]);
    assert!(dir.join("share/man/man5/usbwire.toml.5").exists() && man1.join("usbwire.1").exists());
    let Some(program) = man(&dir.join("usbwire.1")) else {
        eprintln!("man(1) not installed (Debian's man-db): pages written, not rendered");
        return;
    };
    for section in ["EXAMPLES", "EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO", "SUBCOMMANDS"] {
        assert!(program.lines().any(|line| line.trim_end() == section), "usbwire(1) has no {section}:\n{program}");
    }
    for wanted in ["usbwire bind --device 0781:5567", "USBWIRE_REGISTRY", "/var/lib/usbwire/binds", "usbwire.toml(5)"] {
        assert!(program.contains(wanted), "usbwire(1) lacks {wanted}");
    }
    // The exit table, every row: the code, then its sysexits name on the same line.
    for (code, meaning) in [
        ("0", "success"),
        ("64", "usage"),
        ("65", "data"),
        ("69", "unavailable"),
        ("70", "internal"),
        ("71", "OS"),
        ("73", "create"),
        ("74", "I/O"),
        ("75", "temporary"),
        ("77", "permission"),
        ("78", "config"),
    ] {
        let row = program.lines().find(|line| line.split_whitespace().next() == Some(code));
        assert!(row.is_some_and(|line| line.contains(meaning)), "exit status {code}: {row:?}");
    }
    assert!(!program.contains("usbwire-help"), "no reference to a usbwire-help(1) that does not exist");

    let bind = man(&dir.join("usbwire-bind.1")).expect("man");
    assert!(bind.contains("EXAMPLES") && bind.contains("usbwire bind --device serial=4C530001"), "{bind}");
    assert!(bind.contains("SEE ALSO") && bind.contains("usbwire(1)"), "{bind}");

    let config = man(&dir.join("usbwire.toml.5")).expect("man");
    for wanted in
        ["THE SERVER FILE", "THE CLIENT FILE", "THE USER FILE", "[[bind]]", "capture_max_bytes", "[admission]"]
    {
        assert!(config.contains(wanted), "usbwire.toml(5) lacks {wanted}:\n{config}");
    }
}

#[test]
fn help_shows_the_examples_and_describes_every_json_flag() {
    let program = usbwire(&["--help"]);
    for wanted in ["Examples:", "Exit status:", "Environment:", "Files:"] {
        assert!(program.contains(wanted), "usbwire --help lacks {wanted}");
    }
    let verbs: Vec<String> = usbwire_testing::process::verbs_in_help(&program);
    assert!(verbs.len() > 20, "{verbs:?}");
    for verb in &verbs {
        let help = usbwire(&[verb, "--help"]);
        assert!(help.contains("Examples:"), "usbwire {verb} --help has no examples");
        let lines: Vec<&str> = help.lines().collect();
        if let Some(at) = lines.iter().position(|line| line.trim() == "--json") {
            let described =
                lines.get(at + 1).is_some_and(|line| !line.trim().is_empty() && !line.trim().starts_with('-'));
            assert!(described, "usbwire {verb} --help: --json has no description:\n{help}");
        }
    }
}
