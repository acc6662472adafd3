//! One core's AES-256-GCM as `openssl speed` measures it: the reference TLS
//! throughput is put in proportion to (the figure the TLS speed target is
//! defined by), run as a child process in the same benchmark run.
//!
//! Not the record layer's own cipher: [`cipher_speed`](crate::cipher_speed)
//! measures that (aws-lc-rs, in process), which on CPUs with VAES-AVX512
//! runs far ahead of OpenSSL 3.0's figure. Not a parser for `openssl speed`'s
//! other output (other ciphers, sizes, `-mr`).

use std::process::Command;

use serde::Serialize;

/// The command run (16 KiB blocks, as TLS records are, on one core).
pub const COMMAND: [&str; 8] = ["openssl", "speed", "-evp", "aes-256-gcm", "-bytes", "16384", "-seconds", "1"];

/// What `openssl speed` measured.
#[derive(Clone, Debug, Serialize)]
pub struct OpensslSpeed {
    pub mib_per_s: f64,
    /// The command line, to repeat it.
    pub command: String,
}

/// Runs [`COMMAND`] (about a second) and reads its AES-256-GCM line. The
/// error says why there is no figure (no `openssl` on PATH, it failed, or its
/// output was not understood).
pub fn measure() -> Result<OpensslSpeed, String> {
    let output = Command::new(COMMAND[0])
        .args(&COMMAND[1..])
        .output()
        .map_err(|e| format!("cannot run openssl ({e}); install Debian's openssl package for this reference"))?;
    if !output.status.success() {
        return Err(format!("{} exited with {}", COMMAND.join(" "), output.status));
    }
    let mib_per_s = parse(&String::from_utf8_lossy(&output.stdout))
        .ok_or_else(|| format!("no AES-256-GCM figure in the output of {}", COMMAND.join(" ")))?;
    Ok(OpensslSpeed { mib_per_s, command: COMMAND.join(" ") })
}

/// The MiB/s in `openssl speed`'s result line `AES-256-GCM  5445275.59k`
/// (thousands of bytes per second; the last line naming the cipher).
fn parse(stdout: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|line| line.trim_start().starts_with("AES-256-GCM"))?;
    let figure = line.split_whitespace().last()?;
    let thousands: f64 = figure.strip_suffix('k')?.parse().ok()?;
    (thousands > 0.0).then(|| thousands * 1000.0 / f64::from(1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_figure_of_openssl_3() {
        let stdout = "version: 3.0.17\nbuilt on: Sun Jun  1 00:00:00 2025 UTC\noptions: bn(64,64)\n\
                      The 'numbers' are in 1000s of bytes per second processed.\n\
                      type          16384 bytes\nAES-256-GCM    5445275.59k\n";
        let mib = parse(stdout).expect("a figure");
        assert!((mib - 5193.02).abs() < 0.01, "{mib}");
    }

    #[test]
    fn output_without_the_figure_is_none() {
        assert_eq!(parse("type          16384 bytes\n"), None);
        assert_eq!(parse("AES-256-GCM    0.00k\n"), None);
        assert_eq!(parse("AES-256-GCM    fast\n"), None);
    }
}
