//! How a replay answers: [`Mode`] (what a divergent request gets),
//! [`Timing`] (when IN data is given) and where its report goes. Plain values; the replay device reads them.

use super::report::Report;

/// What a request the recording does not have gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// A STALL, as a device that does not know it would answer: a test
    /// fails at the first divergence.
    #[default]
    Strict,
    /// What the recording has (the next IN data, the recorded OUT status);
    /// a STALL only when it has nothing. Every divergence is reported.
    Lenient,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Strict => "strict",
            Self::Lenient => "lenient",
        }
    }
}

/// When IN data is given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Timing {
    /// As soon as it is asked for.
    #[default]
    Asap,
    /// After the time the recorded device took to complete it (capped at
    /// a minute): a keyboard types at its recorded pace.
    Recorded,
}

impl Timing {
    pub fn name(self) -> &'static str {
        match self {
            Self::Asap => "asap",
            Self::Recorded => "recorded",
        }
    }
}

/// Called with the report when an import of the replay ends.
pub type ReportSink = Box<dyn FnMut(&Report) + Send>;

/// A replay's settings.
#[derive(Default)]
pub struct ReplayOptions {
    pub mode: Mode,
    pub timing: Timing,
    /// Where each import's report goes besides the log (a JSON file for CI).
    pub on_report: Option<ReportSink>,
}
