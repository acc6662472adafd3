//! The USB/IP paper's model: at queue depth 1 each URB costs a·size + RTT, so
//! throughput per URB is s / (a·s + RTT); a periodic stream with interval x
//! needs more than RTT/x + 1 URBs queued (Eq. 2).

use serde::Serialize;

/// A least-squares fit of time per URB against URB size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Fit {
    /// Microseconds per KiB (the inverse of the link's bandwidth).
    pub a_us_per_kib: f64,
    /// The intercept: the round-trip cost of a URB in microseconds.
    pub rtt_us: f64,
}

/// Fits `(urb_size_bytes, seconds_per_urb)` points; `None` with fewer than two sizes.
pub fn fit(points: &[(usize, f64)]) -> Option<Fit> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let xs: Vec<f64> = points.iter().map(|(s, _)| *s as f64 / 1024.0).collect();
    let ys: Vec<f64> = points.iter().map(|(_, t)| t * 1e6).collect();
    let mx = xs.iter().sum::<f64>() / n;
    let my = ys.iter().sum::<f64>() / n;
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let a = sxy / sxx;
    Some(Fit { a_us_per_kib: a, rtt_us: my - a * mx })
}

impl Fit {
    /// Whether the fit describes a link: time per URB grows with its size and
    /// a URB costs some time. Noise on a fast path can fit a negative slope or
    /// intercept, which says nothing about the link and must not be reported.
    pub fn is_physical(&self) -> bool {
        self.a_us_per_kib > 0.0 && self.rtt_us > 0.0
    }
}

/// The smallest queue depth q with q > RTT/x + 1 (Eq. 2 of the USB/IP paper).
pub fn advised_depth(rtt_us: f64, interval_us: f64) -> usize {
    (rtt_us.max(0.0) / interval_us + 1.0).floor() as usize + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_line() {
        // 2 µs per KiB, 150 µs round trip.
        let points: Vec<(usize, f64)> =
            [1usize, 4, 16, 64].iter().map(|k| (k * 1024, (2.0 * *k as f64 + 150.0) / 1e6)).collect();
        let f = fit(&points).unwrap();
        assert!((f.a_us_per_kib - 2.0).abs() < 1e-9);
        assert!((f.rtt_us - 150.0).abs() < 1e-6);
        assert_eq!(fit(&points[..1]), None);
        assert!(f.is_physical());
        // Faster big URBs than small ones (noise): a negative slope is not a link.
        let noisy = [(512, 60e-6), (65536, 55e-6), (1 << 20, 50e-6)];
        assert!(!fit(&noisy).unwrap().is_physical());
    }

    #[test]
    fn eq2_depth() {
        // 20 ms RTT, 1 ms interval: q > 21, so 22.
        assert_eq!(advised_depth(20_000.0, 1_000.0), 22);
        assert_eq!(advised_depth(0.0, 1_000.0), 2);
        assert_eq!(advised_depth(20_000.0, 8_000.0), 4);
    }
}
