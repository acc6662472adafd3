//! Records the git commit the binary is built from (`usbwire -V`), or
//! "unknown" when building outside a git checkout (a crates.io tarball).

use std::process::Command;

fn main() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=USBWIRE_COMMIT={commit}{}", if dirty { "-dirty" } else { "" });
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        // A new commit moves HEAD or the branch it points to.
        println!("cargo:rerun-if-changed={dir}/HEAD");
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{branch}");
        }
        println!("cargo:rerun-if-changed={dir}/index");
    }
}
