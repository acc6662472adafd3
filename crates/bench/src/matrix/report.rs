//! What a matrix run found ([`Report`]): its records, the latency samples
//! behind the charts, the fitted model per RTT and direction and, over TLS,
//! the cipher's own speed; as the table `usbwire bench` prints, as JSON and
//! as CSV. No I/O.

use std::fmt::Write as _;

use serde_json::json;

use crate::{cipher_speed, model, openssl_speed, plot, Direction, Record};

/// What a matrix run found.
pub struct Report {
    /// One per point, in the order they ran.
    pub records: Vec<Record>,
    /// Per RTT and direction, the smallest size's depth-1 latencies (for the charts).
    pub latencies: Vec<plot::LatencySamples>,
    pub(super) fits: Vec<(f64, Direction, model::Fit)>,
    /// Over TLS: one core's AES-GCM in the same run, to put each rate in proportion.
    pub(super) cipher: Option<cipher_speed::CipherSpeed>,
    /// Over TLS: `openssl speed`'s one-core AES-256-GCM in the same run (the TLS
    /// target's reference), or why there is none.
    pub(super) openssl: Option<Result<openssl_speed::OpensslSpeed, String>>,
}

impl Report {
    /// The document `usbwire bench --json` prints.
    pub fn json(&self) -> serde_json::Value {
        let fits: Vec<_> = self
            .fits
            .iter()
            .map(|(rtt_ms, direction, fit)| {
                if !fit.is_physical() {
                    return json!({
                        "rtt_ms": rtt_ms,
                        "direction": direction,
                        "unfitted": "the depth-1 times do not grow with URB size (noise on a fast path): no model",
                    });
                }
                json!({
                    "rtt_ms": rtt_ms,
                    "direction": direction,
                    "a_us_per_kib": fit.a_us_per_kib,
                    "round_trip_us": fit.rtt_us,
                    "advised_depth_1ms": model::advised_depth(fit.rtt_us, 1000.0),
                    "advised_depth_8ms": model::advised_depth(fit.rtt_us, 8000.0),
                })
            })
            .collect();
        let records: Vec<_> = self
            .records
            .iter()
            .map(|r| {
                let mut value = serde_json::to_value(r).unwrap_or_default();
                if let (Some(problem), Some(object)) = (r.measurement_problem(), value.as_object_mut()) {
                    object.insert("measurement_problem".into(), problem.into());
                }
                if let (Some(cipher), Some(object)) = (self.cipher, value.as_object_mut()) {
                    object.insert("ratio_to_cipher".into(), (r.mib_per_s / cipher.mib_per_s).into());
                }
                if let (Some(openssl), Some(object)) = (self.openssl_mib_per_s(), value.as_object_mut()) {
                    object.insert("ratio_to_openssl".into(), (r.mib_per_s / openssl).into());
                }
                value
            })
            .collect();
        let openssl = self.openssl.as_ref().map(|measured| match measured {
            Ok(speed) => json!(speed),
            Err(why) => json!({ "error": why }),
        });
        json!({ "records": records, "model": fits, "cipher_one_core": self.cipher, "openssl_aes_256_gcm": openssl })
    }

    /// `openssl speed`'s figure, when it was measured.
    fn openssl_mib_per_s(&self) -> Option<f64> {
        self.openssl.as_ref().and_then(|measured| measured.as_ref().ok()).map(|speed| speed.mib_per_s)
    }

    /// The table `usbwire bench` (and `usbwire demo`) prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        if let Some(cipher) = self.cipher {
            let _ = writeln!(
                out,
                "one core {}, 16 KiB records: {:.0} MiB/s (the `cipher` column: MiB/s over it)",
                cipher.cipher, cipher.mib_per_s
            );
        }
        match &self.openssl {
            Some(Ok(speed)) => {
                let _ = writeln!(
                    out,
                    "`{}`: {:.0} MiB/s (the `openssl` column: MiB/s over it)",
                    speed.command, speed.mib_per_s
                );
            }
            Some(Err(why)) => {
                let _ = writeln!(out, "no `openssl speed` figure: {why}");
            }
            None => {}
        }
        let openssl = self.openssl_mib_per_s();
        let _ = writeln!(
            out,
            "{:>6} {:>4} {:>9} {:>5} {:>10} {:>13} {:>10} {:>6} {:>9} {:>9} {:>9} {:>6} {:>7}",
            "rtt_ms",
            "dir",
            "urb_size",
            "depth",
            "MiB/s",
            "runs",
            "raw MiB/s",
            "ratio",
            "p50 us",
            "raw p50",
            "compress",
            if self.cipher.is_some() { "cipher" } else { "" },
            if openssl.is_some() { "openssl" } else { "" }
        );
        let mut problems = Vec::new();
        for r in &self.records {
            let problem = r.measurement_problem();
            let ratio = format!("{:.2}{}", r.ratio_to_raw_tcp, if problem.is_some() { "!" } else { "" });
            let _ = writeln!(
                out,
                "{:>6} {:>4} {:>9} {:>5} {:>10.1} {:>13} {:>10.1} {:>6} {:>9.0} {:>9.0} {:>9} {:>6} {:>7}",
                r.rtt_ms,
                format!("{:?}", r.direction).to_lowercase(),
                r.urb_size,
                r.depth,
                r.mib_per_s,
                spread(&r.runs_mib_per_s),
                r.raw_tcp_mib_per_s,
                ratio,
                r.latency_us.p50,
                r.raw_tcp_latency_us.p50,
                r.compression_ratio.map_or("-".to_owned(), |c| format!("{c:.1}x")),
                self.cipher.map_or(String::new(), |c| format!("{:.2}", r.mib_per_s / c.mib_per_s)),
                openssl.map_or(String::new(), |o| format!("{:.2}", r.mib_per_s / o))
            );
            problems.extend(problem);
        }
        if let Some(problem) = problems.first() {
            let _ = writeln!(out, "\n! {} point(s) not trusted: {problem}", problems.len());
        }
        for (rtt_ms, direction, fit) in &self.fits {
            if !fit.is_physical() {
                let _ = writeln!(
                    out,
                    "\nmodel (rtt {rtt_ms} ms, {direction:?}): not fitted: the depth-1 times do not grow with URB size \
                     (noise on a fast path); measure with --rtt-ms or more sizes"
                );
                continue;
            }
            let _ = writeln!(
                out,
                "\nmodel (rtt {rtt_ms} ms, {direction:?}): time per URB = {:.3} us/KiB x size + {:.0} us; a periodic stream needs depth > RTT/x + 1: {} URBs at 1 ms, {} at 8 ms",
                fit.a_us_per_kib,
                fit.rtt_us,
                model::advised_depth(fit.rtt_us, 1000.0),
                model::advised_depth(fit.rtt_us, 8000.0)
            );
        }
        out
    }

    /// The records as the CSV `usbwire bench --csv FILE` writes, a header line first.
    pub fn csv(&self) -> String {
        let mut out = String::from("direction,urb_size,depth,rtt_ms,mib_per_s,raw_tcp_mib_per_s,ratio_to_raw_tcp,urbs_per_s,p50_us,p90_us,p99_us,max_us,raw_p50_us,raw_p99_us\n");
        for r in &self.records {
            let _ = writeln!(
                out,
                "{},{},{},{},{:.3},{:.3},{:.4},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1}",
                format!("{:?}", r.direction).to_lowercase(),
                r.urb_size,
                r.depth,
                r.rtt_ms,
                r.mib_per_s,
                r.raw_tcp_mib_per_s,
                r.ratio_to_raw_tcp,
                r.urbs_per_s,
                r.latency_us.p50,
                r.latency_us.p90,
                r.latency_us.p99,
                r.latency_us.max,
                r.raw_tcp_latency_us.p50,
                r.raw_tcp_latency_us.p99
            );
        }
        out
    }
}

/// The runs' range, `min–max` (one run: its value).
fn spread(runs: &[f64]) -> String {
    let min = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match runs.len() {
        0 => "-".into(),
        1 => format!("{min:.1}"),
        _ => format!("{min:.0}–{max:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Percentiles;

    #[test]
    fn the_runs_column_is_their_range() {
        assert_eq!(spread(&[]), "-");
        assert_eq!(spread(&[123.456]), "123.5");
        assert_eq!(spread(&[120.4, 99.6, 130.2]), "100–130");
    }

    #[test]
    fn the_csv_has_a_header_and_a_line_per_record() {
        let record = Record {
            direction: Direction::Out,
            urb_size: 512,
            depth: 8,
            rtt_ms: 0.5,
            mib_per_s: 12.5,
            raw_tcp_mib_per_s: 25.0,
            ratio_to_raw_tcp: 0.5,
            urbs_per_s: 25600.0,
            latency_us: Percentiles { p50: 30.0, p90: 40.0, p99: 50.0, max: 60.0 },
            raw_tcp_latency_us: Percentiles { p50: 10.0, p90: 11.0, p99: 12.0, max: 13.0 },
            compression_ratio: None,
            runs_mib_per_s: vec![12.5],
            raw_tcp_runs_mib_per_s: vec![25.0],
        };
        let report =
            Report { records: vec![record], latencies: Vec::new(), fits: Vec::new(), cipher: None, openssl: None };
        let csv = report.csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 2, "{csv}");
        assert!(lines[0].starts_with("direction,urb_size,depth,rtt_ms,"), "{csv}");
        assert_eq!(lines[1], "out,512,8,0.5,12.500,25.000,0.5000,25600.0,30.0,40.0,50.0,60.0,10.0,12.0");
    }
}
