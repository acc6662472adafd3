//! PNG charts of a benchmark: throughput against URB size (one line per queue
//! depth, the raw-TCP ceiling dashed beside it), per direction and RTT; and the
//! latency CDF of small URBs at depth 1, usbwire against raw TCP.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::{Direction, Record};

/// Latency samples (µs, sorted) of one depth-1 point, ours and the ceiling's.
#[derive(Clone, Debug)]
pub struct LatencySamples {
    pub rtt_ms: f64,
    pub direction: Direction,
    pub urb_size: usize,
    pub ours: Vec<f64>,
    pub raw: Vec<f64>,
}

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Okabe–Ito: told apart by readers with any colour vision (and in grey).
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(0, 158, 115),   // bluish green
    RGBColor(204, 121, 167), // reddish purple
    RGBColor(230, 159, 0),   // orange
    RGBColor(86, 180, 233),  // sky blue
    RGBColor(0, 0, 0),       // black
];

/// A byte count as a tick label: 512 B, 64 KiB, 1 MiB (1.5 MiB between powers).
fn bytes_label(bytes: &f64) -> String {
    let b = *bytes;
    let (value, unit) = if b >= 1024.0 * 1024.0 {
        (b / (1024.0 * 1024.0), "MiB")
    } else if b >= 1024.0 {
        (b / 1024.0, "KiB")
    } else {
        (b, "B")
    };
    if (value - value.round()).abs() < 0.05 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// DejaVu Sans (fonts/DejaVuSans.LICENSE), built in: text needs no font
/// library or font file on the machine.
const SANS: &[u8] = include_bytes!("../fonts/DejaVuSans.ttf");

/// Registers the built-in font as "sans-serif", once.
fn register_fonts() -> PlotResult<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, SANS).is_ok());
    if ok {
        Ok(())
    } else {
        Err("the built-in font could not be loaded".into())
    }
}

/// Writes every chart into `dir`; returns the files written.
pub fn write_all(dir: &Path, records: &[Record], latencies: &[LatencySamples]) -> PlotResult<Vec<PathBuf>> {
    register_fonts()?;
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let mut rtts: Vec<f64> = records.iter().map(|r| r.rtt_ms).collect();
    rtts.dedup();
    for rtt in rtts {
        for direction in [Direction::In, Direction::Out] {
            let points: Vec<&Record> = records.iter().filter(|r| r.rtt_ms == rtt && r.direction == direction).collect();
            if points.is_empty() {
                continue;
            }
            let name = format!("throughput-{}-rtt{rtt}ms.png", if direction == Direction::In { "in" } else { "out" });
            let path = dir.join(name);
            throughput(&path, rtt, direction, &points)?;
            written.push(path);
        }
    }
    for samples in latencies {
        let name = format!(
            "latency-cdf-{}-{}B-rtt{}ms.png",
            if samples.direction == Direction::In { "in" } else { "out" },
            samples.urb_size,
            samples.rtt_ms
        );
        let path = dir.join(name);
        cdf(&path, samples)?;
        written.push(path);
    }
    Ok(written)
}

fn throughput(path: &Path, rtt: f64, direction: Direction, points: &[&Record]) -> PlotResult<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let min_size = points.iter().map(|r| r.urb_size).min().unwrap_or(512) as f64;
    let max_size = points.iter().map(|r| r.urb_size).max().unwrap_or(1 << 20) as f64;
    let top = points.iter().map(|r| r.mib_per_s.max(r.raw_tcp_mib_per_s)).fold(1.0, f64::max) * 1.1;
    let title = format!("{direction:?} throughput, RTT {rtt} ms (solid: usbwire, dashed: raw TCP)");
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((min_size * 0.9..max_size * 1.1).log_scale().base(2.0), 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("URB size")
        .x_label_formatter(&bytes_label)
        .y_desc("MiB/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    let mut depths: Vec<usize> = points.iter().map(|r| r.depth).collect();
    depths.sort_unstable();
    depths.dedup();
    for (i, depth) in depths.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut line: Vec<&&Record> = points.iter().filter(|r| r.depth == *depth).collect();
        line.sort_by_key(|r| r.urb_size);
        let measured: Vec<(f64, f64)> = line.iter().map(|r| (r.urb_size as f64, r.mib_per_s)).collect();
        chart
            .draw_series(LineSeries::new(measured.iter().copied(), color.stroke_width(2)))?
            .label(format!("depth {depth}"))
            .legend(move |(x, y)| {
                EmptyElement::at((x + 10, y))
                    + PathElement::new(vec![(-10, 0), (10, 0)], color.stroke_width(2))
                    + Circle::new((0, 0), 4, color.filled())
            });
        chart.draw_series(measured.iter().map(|&point| Circle::new(point, 4, color.filled())))?;
        // The ceiling as a dashed line in the same colour.
        let raw: Vec<(f64, f64)> = line.iter().map(|r| (r.urb_size as f64, r.raw_tcp_mib_per_s)).collect();
        for pair in raw.windows(2) {
            chart.draw_series(DashedLineSeries::new(pair.iter().copied(), 6, 4, color.stroke_width(1)))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn cdf(path: &Path, samples: &LatencySamples) -> PlotResult<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = samples.ours.iter().chain(&samples.raw).fold(1.0, |a: f64, b| a.max(*b));
    let title = format!(
        "Latency CDF, {} B {:?} at depth 1, RTT {} ms (blue: usbwire, vermillion: raw TCP)",
        samples.urb_size, samples.direction, samples.rtt_ms
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1f64..max * 1.1).log_scale(), 0f64..1f64)?;
    chart.configure_mesh().x_desc("round trip (µs)").y_desc("fraction of URBs").draw()?;
    for (values, color) in [(&samples.ours, PALETTE[0]), (&samples.raw, PALETTE[1])] {
        let n = values.len().max(1) as f64;
        chart.draw_series(LineSeries::new(
            values.iter().enumerate().map(|(i, v)| (v.max(1.0), (i + 1) as f64 / n)),
            color.stroke_width(2),
        ))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Percentiles;

    fn record(direction: Direction, urb_size: usize, depth: usize, mib_per_s: f64) -> Record {
        Record {
            direction,
            urb_size,
            depth,
            rtt_ms: 0.0,
            mib_per_s,
            raw_tcp_mib_per_s: mib_per_s * 1.2,
            ratio_to_raw_tcp: 1.0 / 1.2,
            urbs_per_s: 0.0,
            latency_us: Percentiles::default(),
            raw_tcp_latency_us: Percentiles::default(),
            compression_ratio: None,
            runs_mib_per_s: vec![mib_per_s],
            raw_tcp_runs_mib_per_s: vec![mib_per_s * 1.2],
        }
    }

    /// A PNG's width and height, from its IHDR chunk.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn byte_ticks_read_in_units() {
        assert_eq!(bytes_label(&512.0), "512 B");
        assert_eq!(bytes_label(&65536.0), "64 KiB");
        assert_eq!(bytes_label(&1048576.0), "1 MiB");
        assert_eq!(bytes_label(&1572864.0), "1.5 MiB");
    }

    #[test]
    fn charts_are_drawn_with_the_built_in_font() {
        let dir = std::env::temp_dir().join(format!("usbwire-plot-{}", std::process::id()));
        let records: Vec<Record> = [512, 65536, 1 << 20]
            .into_iter()
            .flat_map(|size| {
                [1, 8].map(|depth| record(Direction::In, size, depth, (size as f64).sqrt() * depth as f64))
            })
            .collect();
        let latencies = [LatencySamples {
            rtt_ms: 0.0,
            direction: Direction::In,
            urb_size: 512,
            ours: (1..=100).map(|i| 40.0 + f64::from(i)).collect(),
            raw: (1..=100).map(|i| 30.0 + f64::from(i)).collect(),
        }];
        let written = write_all(&dir, &records, &latencies).expect("charts drawn");
        assert_eq!(written.len(), 2, "{written:?}");
        for path in &written {
            let bytes = std::fs::read(path).unwrap();
            assert_eq!(png_size(&bytes), (900, 560), "{}", path.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
